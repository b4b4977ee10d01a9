#!/usr/bin/env bash
# pbs/node_task.sh: what pbs/train.pbs runs on each node (through pbsdsh or ssh).
#   node_task.sh WORKDIR CONFIG NUM_NODES NODE_RANK MASTER_ADDR MASTER_PORT [key=value ...]
# pbsdsh starts tasks in the home folder; the launcher and relative config paths need the job's.
set -euo pipefail
cd "${1:?usage: node_task.sh WORKDIR CONFIG NUM_NODES NODE_RANK MASTER_ADDR MASTER_PORT [key=value ...]}"
exec ./cluster_train.sh "$2" "$3" "$4" "$5" "$6" -- "${@:7}"
