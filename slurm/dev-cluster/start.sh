#!/usr/bin/env bash
# Start a real two-node Slurm cluster on this one machine (for tests and demos). Needs root.
#
# Installs slurmctld, slurmd, munge and the client tools with apt-get when they are missing, writes
# /etc/slurm/slurm.conf (nodes n1 and n2 on 127.0.1.1 / 127.0.1.2, each slurmd on its own port,
# partition "debug"; each node declares this machine's real CPUs and memory), starts munged, slurmctld and two `slurmd -N` daemons and waits until both
# nodes are idle. Idempotent: a running cluster is left as it is. Bounded: gives up after
# OOMLESS_SLURM_START_TIMEOUT_S seconds (default 120) with exit status 1.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
. "$HERE/common.sh"

deadline=$((SECONDS + ${OOMLESS_SLURM_START_TIMEOUT_S:-120}))

if [ "$(id -u)" != 0 ]; then
  echo "dev-cluster: needs root (apt-get, daemons as root)" >&2
  exit 1
fi

if daemons_alive && nodes_idle; then
  echo "dev-cluster: already up"
  sinfo
  exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
  || ! command -v munged >/dev/null || ! command -v sbatch >/dev/null; then
  echo "dev-cluster: installing slurm and munge with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  left=$((deadline - SECONDS))
  timeout "$left" apt-get update -qq
  left=$((deadline - SECONDS))
  timeout "$left" apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
fi

# Node names resolve to their own loopback addresses.
for pair in "127.0.1.1 n1" "127.0.1.2 n2"; do
  grep -qE "^${pair% *}[[:space:]]+${pair#* }\$" /etc/hosts || echo "$pair" >>/etc/hosts
done

mkdir -p "$STATE_DIR"/ctld "$STATE_DIR"/n1 "$STATE_DIR"/n2 "$STATE_DIR"/log /etc/slurm
if [ -f "$CONF" ] && ! grep -q "$MARKER" "$CONF"; then
  echo "dev-cluster: $CONF exists and is not ours; not touching it" >&2
  exit 1
fi
# every node declares this machine's real CPUs and memory (MiB)
cpus="$(nproc --all)"
memory_mb="$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)"
sed -e "s|@STATE_DIR@|$STATE_DIR|g" -e "s|@MARKER@|$MARKER|g" \
  -e "s|@CPUS@|$cpus|g" -e "s|@MEMORY_MB@|$memory_mb|g" \
  "$HERE/slurm.conf.in" >"$CONF.new"
if [ -f "$CONF" ] && ! cmp -s "$CONF" "$CONF.new" && pidfile_alive "$STATE_DIR/slurmctld.pid"; then
  # a cluster started from an older conf (other sizes): reload it with the new one
  mv "$CONF.new" "$CONF"
  scontrol reconfigure >/dev/null 2>&1 || true
else
  mv "$CONF.new" "$CONF"
fi

# no cgroup.conf: the cgroup plugins are off in slurm.conf

if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown munge:munge /etc/munge/munge.key 2>/dev/null || true
chmod 400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  if id munge >/dev/null 2>&1; then
    runuser -u munge -- munged --force
  else
    munged --force
  fi
fi

pidfile_alive "$STATE_DIR/slurmctld.pid" || slurmctld -f "$CONF"
for node in n1 n2; do
  pidfile_alive "$STATE_DIR/slurmd-$node.pid" || slurmd -f "$CONF" -N "$node"
done

until nodes_idle; do
  if [ "$SECONDS" -ge "$deadline" ]; then
    echo "dev-cluster: nodes not idle in time; logs in $STATE_DIR/log" >&2
    sinfo -N -l >&2 || true
    exit 1
  fi
  # Nodes left DOWN/DRAIN from an earlier run come back on their own with ReturnToService=2;
  # resume them explicitly in case.
  scontrol update nodename=n1,n2 state=resume >/dev/null 2>&1 || true
  sleep 1
done
echo "dev-cluster: up"
sinfo
