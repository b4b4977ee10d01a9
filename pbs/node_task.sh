#!/usr/bin/env bash
# pbs/node_task.sh: what pbs/train.pbs and pbs/ray.pbs run on each node (pbs/nodes.sh).
#   node_task.sh WORKDIR [--env FILE] [--status FILE] COMMAND [ARGS...]
# pbsdsh starts tasks in the home folder; the launcher, relative config paths and the Python
# modules need the job's. --env FILE holds the job's settings (NAME=VALUE, NUL-separated, mode
# 0600), for launchers that start a bare environment: exported here, then removed. --status FILE
# receives COMMAND's exit code when it ends: OpenPBS's pbsdsh exits 0 once its task has ended,
# whatever the task's code (1 after forwarding a signal), and ssh's code is lost with the
# connection, so the batch script reads the task's own answer there (pbs_task_code).
set -euo pipefail
cd "${1:?usage: node_task.sh WORKDIR [--env FILE] [--status FILE] COMMAND [ARGS...]}"
shift
if [[ "${1:-}" == --env ]]; then
  while IFS= read -r -d '' setting; do export "${setting?}"; done <"${2:?--env needs a file}"
  rm -f "$2"
  shift 2
fi
status_file=""
if [[ "${1:-}" == --status ]]; then
  status_file="${2:?--status needs a file}"
  shift 2
fi
# A task started by ssh carries sshd's session variables, and a bash that sees SSH_CLIENT with a
# low SHLVL believes sshd started it and reads ~/.bashrc even non-interactively (Debian's bash).
# Ray starts its workers through `bash -c` with an environment of its own making: a ~/.bashrc
# that puts pyenv or conda first on PATH then ran the job's driver under another Python.
unset SSH_CLIENT SSH2_CLIENT SSH_CONNECTION SSH_TTY
[[ -n "${status_file}" ]] || exec "$@"

# With --status (pbsdsh and ssh, never srun: SLURM may signal the task's process alone, which
# then must be COMMAND) the stop signals reach COMMAND with the rest of the task's session (the
# MoM's tm_kill); here they only interrupt the wait, which goes on until COMMAND has ended (a
# trap, not an ignore: an ignored signal would be ignored by COMMAND too).
trap ':' TERM INT HUP
# Without job control bash starts a background command with INT and QUIT ignored: restored here.
(trap - INT QUIT && exec "$@") &
child=$!
while :; do
  code=0
  wait "${child}" || code=$?
  # A trapped signal ends the wait early (>128) while COMMAND runs on; an unreaped COMMAND keeps its pid.
  ((code > 128)) && kill -0 "${child}" 2>/dev/null && continue
  break
done
if ((code > 128)); then # the signal's code, or COMMAND's own: COMMAND's if it is still to be reaped
  last=0
  wait "${child}" 2>/dev/null || last=$?
  ((last == 127)) || code="${last}"
fi
printf '%s\n' "${code}" >"${status_file}.tmp" && mv -f "${status_file}.tmp" "${status_file}"
exit "${code}"
