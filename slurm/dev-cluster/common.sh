# Shared by start.sh, stop.sh and status.sh (sourced).
STATE_DIR="${OOMLESS_SLURM_STATE_DIR:-/var/lib/oomless-slurm}"
CONF=/etc/slurm/slurm.conf
MARKER="written by oomless slurm/dev-cluster"

pidfile_alive() {
  [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

nodes_idle() {
  local states
  states="$(sinfo -h -N -o '%N %T' 2>/dev/null | sort -u)" || return 1
  echo "$states" | grep -qE '^n1 (idle|mixed|allocated)' \
    && echo "$states" | grep -qE '^n2 (idle|mixed|allocated)'
}

daemons_alive() {
  pidfile_alive "$STATE_DIR/slurmctld.pid" && pidfile_alive "$STATE_DIR/slurmd-n1.pid" \
    && pidfile_alive "$STATE_DIR/slurmd-n2.pid"
}
