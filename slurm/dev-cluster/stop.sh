#!/usr/bin/env bash
# Stop the local two-node Slurm cluster started by start.sh (jobs are cancelled; state is kept).
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
. "$HERE/common.sh"
scancel --user="$(id -un)" 2>/dev/null || true
for pidfile in "$STATE_DIR"/slurmd-n1.pid "$STATE_DIR"/slurmd-n2.pid "$STATE_DIR"/slurmctld.pid; do
  if pidfile_alive "$pidfile"; then
    pid="$(cat "$pidfile")"
    kill "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  fi
done
echo "dev-cluster: stopped (munged left running)"
