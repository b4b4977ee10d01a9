#!/usr/bin/env bash
# pbs/node_task.sh: what pbs/train.pbs and pbs/ray.pbs run on each node (pbs/nodes.sh).
#   node_task.sh WORKDIR COMMAND [ARGS...]
# pbsdsh starts tasks in the home folder; the launcher, relative config paths and the Python
# modules need the job's.
set -euo pipefail
cd "${1:?usage: node_task.sh WORKDIR COMMAND [ARGS...]}"
shift
exec "$@"
