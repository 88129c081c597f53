#!/usr/bin/env bash
# Exit 0 and print the nodes when the local two-node cluster is up, else exit 1.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
. "$HERE/common.sh"
if nodes_idle; then
  sinfo -N -l
  squeue
  exit 0
fi
echo "dev-cluster: not up (start it with slurm/dev-cluster/start.sh)" >&2
exit 1
