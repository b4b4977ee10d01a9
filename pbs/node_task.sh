#!/usr/bin/env bash
# pbs/node_task.sh: what pbs/train.pbs and pbs/ray.pbs run on each node (pbs/nodes.sh).
#   node_task.sh WORKDIR [--env FILE] COMMAND [ARGS...]
# pbsdsh starts tasks in the home folder; the launcher, relative config paths and the Python
# modules need the job's. FILE holds the job's settings (NAME=VALUE, NUL-separated, mode 0600),
# for launchers that start a bare environment: exported here, then removed.
set -euo pipefail
cd "${1:?usage: node_task.sh WORKDIR [--env FILE] COMMAND [ARGS...]}"
shift
if [[ "${1:-}" == --env ]]; then
  while IFS= read -r -d '' setting; do export "${setting?}"; done <"${2:?--env needs a file}"
  rm -f "$2"
  shift 2
fi
# A task started by ssh carries sshd's session variables, and a bash that sees SSH_CLIENT with a
# low SHLVL believes sshd started it and reads ~/.bashrc even non-interactively (Debian's bash).
# Ray starts its workers through `bash -c` with an environment of its own making: a ~/.bashrc
# that puts pyenv or conda first on PATH then ran the job's driver under another Python.
unset SSH_CLIENT SSH2_CLIENT SSH_CONNECTION SSH_TTY
exec "$@"
