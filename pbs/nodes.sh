# shellcheck shell=bash
# pbs/nodes.sh: what pbs/train.pbs and pbs/ray.pbs share, sourced by both from the job's folder.
#
#   pbs_job_arguments ARG...  CONFIG (default: the embedded default) and JOB_OVERRIDES (array): the
#                             script's arguments, else OVERRIDES split on spaces (qsub passes none)
#   pbs_job_number            the number of PBS_JOBID ("4242.server" -> 4242; 0 without one)
#   pbs_hosts                 PBS_HOSTS and PBS_HOST_INDEXES (arrays): the unique hosts of
#                             PBS_NODEFILE in file order, and each one's first line (its vnode)
#   pbs_run_on INDEX CMD...   run CMD on host INDEX, in the job's folder with the job's settings
#                             (PBS_LAUNCHER: pbsdsh, srun or ssh; see below). It execs: call it
#                             in the background (&), and $! is the task's own pid
#   pbs_forget_env            at the job's end: the settings files of tasks that never started,
#                             and the tasks' exit-code files
#   pbs_task_code INDEX CODE AGO  the exit code of host INDEX's task once it has ended (its client's
#                             exit code CODE, AGO seconds since the client ended), or nothing while
#                             it may still be running
#   pbs_stop_tasks SIG PID... ask the tasks started through pbs_run_on to end (SIGTERM), or their
#                             Ray to go down (SIGUSR2)
#   pbs_rerun_check           RESUME=auto when this job id ran before (qrerun, a server restart)
#   pbs_stop_before_walltime [NEEDED_S [WHAT]]  SIGTERM to this script STOP_BEFORE_WALLTIME s (300)
#                             before the job's walltime: PBS sends nothing before the walltime's
#                             SIGTERM and SIGKILL kill_delay later (10 s by default), too soon for
#                             a checkpoint, so the job stops itself first, through the path qdel
#                             takes. The walltime: WALLTIME (seconds or [[H:]M:]S), else Torque's
#                             PBS_WALLTIME, else `qstat -f` (OpenPBS, PBS Pro); 0 turns it off.
#                             A margin under NEEDED_S (what the stop takes) ends the job with 2
#
# PBS_LAUNCHER picks how a host's task starts: pbsdsh where PBS has it; srun where the PBS job
# runs on SLURM (slurm-wlm-torque's qsub), which has no pbsdsh; else passwordless ssh.
# PBS_SSH is the ssh command, split on spaces (default `ssh -o BatchMode=yes`): a site's port,
# key or jump host goes there (`PBS_SSH="ssh -o BatchMode=yes -p 2222"`), or in ~/.ssh/config.

# What reaches every node: pbsdsh and ssh start a bare environment there, and the launcher
# promises that a variable you exported is never overridden, so this job's own settings go
# along: the launcher's variables by name, and the libraries' families by prefix.
readonly FORWARD_VARS=(PATH LD_LIBRARY_PATH PYTHONPATH VIRTUAL_ENV NPROC_PER_NODE BACKEND LOG_LEVEL CONDA_ENV VENV
  LOG_DIR LOG_RANKS LOG_MAX_BYTES LOG_BACKUPS LOG_KEEP_RUNS MAX_RESTARTS RDZV_TIMEOUT RDZV_STORE_TIMEOUT
  RDZV_LAST_CALL_S RDZV_ID MONITOR_INTERVAL WORKER_START HEALTH_CHECKS HEALTH_MIN_FREE_GB NCCL_PRESET NODE_ADDR RESUME)
# WANDB_ and MLFLOW_: the trackers' credentials and settings (docs/SCHEDULERS.md); rank 0 logs.
readonly FORWARD_PREFIXES=(NCCL_ TORCH_ CUDA_ HF_ TRANSFORMERS_ TOKENIZERS_ OMP_ MKL_ GLOO_ UCX_ FI_ PURRSIGHT_ RAY_
  WANDB_ MLFLOW_)

# NAME=value for every exported variable this job forwards, NUL-terminated (values may hold newlines).
forwarded_env() {
  local var prefix
  while read -r var; do
    for prefix in "${FORWARD_VARS[@]/%/=}" "${FORWARD_PREFIXES[@]}"; do
      if [[ "${var}=" == "${prefix}" || ("${prefix}" != *= && "${var}" == "${prefix}"*) ]]; then
        printf '%s=%s\0' "${var}" "${!var}"
        break
      fi
    done
  done < <(compgen -e)
}

pbs_job_arguments() {
  CONFIG="${CONFIG:-config/train_config.yaml}"
  JOB_OVERRIDES=("$@")
  if ((${#JOB_OVERRIDES[@]} == 0)) && [[ -n "${OVERRIDES:-}" ]]; then read -r -a JOB_OVERRIDES <<<"${OVERRIDES}"; fi
}

pbs_job_number() {
  local number="${PBS_JOBID:-0}"
  number="${number%%.*}"
  number="${number//[^0-9]/}"
  printf '%s\n' "${number:-0}"
}

pbs_hosts() {
  local line=0 host
  declare -A seen=()
  PBS_HOSTS=()
  PBS_HOST_INDEXES=()
  [[ -r "${PBS_NODEFILE:-}" ]] || { log "error: PBS_NODEFILE is not set or not readable (run this through qsub)"; exit 2; }
  while read -r host _; do
    if [[ -n "${host}" && -z "${seen[${host}]:-}" ]]; then
      seen[${host}]=1
      PBS_HOSTS+=("${host}")
      PBS_HOST_INDEXES+=("${line}")
    fi
    line=$((line + 1))
  done <"${PBS_NODEFILE}"
}

pbs_launcher() {
  if [[ -n "${PBS_LAUNCHER:-}" ]]; then
    printf '%s\n' "${PBS_LAUNCHER}"
  elif command -v pbsdsh >/dev/null; then
    echo pbsdsh
  elif [[ -n "${SLURM_JOB_ID:-}" ]] && command -v srun >/dev/null; then
    echo srun
  else
    echo ssh
  fi
}

# A pbsdsh or ssh task writes its exit code here when it ends (node_task.sh --status): OpenPBS's
# pbsdsh exits 0 once its task has ended whatever the task's code, and 1 right after forwarding
# a signal while the task runs on; an ssh client ends on the job's SIGTERM, its task running on.
# (srun's code is its task's.)
pbs_status_file() {
  printf '%s\n' "${WORKDIR}/logs/.pbs-status-$(pbs_job_number)-$1"
}

pbs_run_on() {
  local index="$1"
  shift
  local launcher env_file status_file
  launcher="$(pbs_launcher)"
  env_file="${WORKDIR}/logs/.pbs-env-$(pbs_job_number)-${index}"
  status_file="$(pbs_status_file "${index}")"
  if [[ "${launcher}" == srun ]]; then
    # srun hands the job's environment over itself, the scheduler's own way: nothing to write.
    # Its code is its task's, and SLURM signals the task's process: node_task.sh execs it.
    exec srun --overlap --nodes=1 --ntasks=1 --cpus-per-task="$(pbs_host_cpus "${index}")" \
      --nodelist="${PBS_HOSTS[index]}" "${WORKDIR}/pbs/node_task.sh" "${WORKDIR}" "$@"
  fi
  # pbsdsh and ssh start a bare environment: the job's settings go in a file only this user
  # can read (on the job's folder, which every node mounts), never as `env NAME=VALUE`
  # arguments, which /proc/PID/cmdline shows every local user for the task's whole life.
  # node_task.sh reads it and removes it.
  (umask 077 && mkdir -p "${WORKDIR}/logs" && forwarded_env >"${env_file}")
  local task=("${WORKDIR}/pbs/node_task.sh" "${WORKDIR}" --env "${env_file}" --status "${status_file}" "$@")
  case "${launcher}" in
    pbsdsh) exec pbsdsh -n "${PBS_HOST_INDEXES[index]}" -- "${task[@]}" ;;
    # ssh takes one command string; every word is quoted for the remote shell, never evaluated here.
    *)
      local -a ssh_command
      read -r -a ssh_command <<<"${PBS_SSH:-ssh -o BatchMode=yes}"
      exec "${ssh_command[@]}" "${PBS_HOSTS[index]}" "$(printf '%q ' "${task[@]}")"
      ;;
  esac
}

# The slots (cores) the job holds on host INDEX: its lines in PBS_NODEFILE, one per slot, matched
# by their first word as pbs_hosts reads them (a line may carry trailing spaces); at least 1.
pbs_host_cpus() {
  awk -v host="${PBS_HOSTS[$1]}" '$1 == host { slots++ } END { print (slots > 0 ? slots : 1) }' "${PBS_NODEFILE}"
}

# The env files of tasks that never started (a failed pbsdsh), and the tasks' exit codes: removed
# at the job's end.
pbs_forget_env() {
  rm -f "${WORKDIR}/logs/.pbs-env-$(pbs_job_number)-"* "${WORKDIR}/logs/.pbs-status-$(pbs_job_number)-"*
}

# pbs_task_code INDEX CLIENT_CODE AGO: host INDEX's task's exit code, its client (pbsdsh, ssh or
# srun) having ended with CLIENT_CODE AGO seconds ago; nothing while the task may still run. The task's own answer when
# it gave one; else srun's code, which is its task's. Otherwise the task may still be running, or
# its answer not yet visible here (a shared filesystem's attribute cache: NFS's acdirmax is 60 s): a
# pbsdsh that ended 0 (its task ended, or never spawned) is given PBS_STATUS_WAIT_S (60) for the
# answer to appear, any other client end (pbsdsh after forwarding a signal, ssh) PBS_TASK_WAIT_S
# (300) for the task to end; then the task counts as failed.
pbs_task_code() {
  local index="$1" client="$2" ago="$3" file limit
  file="$(pbs_status_file "${index}")"
  if [[ -s "${file}" ]]; then
    cat "${file}"
    return 0
  fi
  if [[ "$(pbs_launcher)" == srun ]]; then
    printf '%s\n' "${client}"
    return 0
  fi
  limit="${PBS_TASK_WAIT_S:-300}"
  [[ "$(pbs_launcher)" != pbsdsh || "${client}" != 0 ]] || limit="${PBS_STATUS_WAIT_S:-60}"
  if ((ago >= limit)); then
    printf '%s\n' "$((client == 0 ? 1 : client))"
  fi
}

pbs_stop_tasks() {
  local sig="$1" pid
  shift
  if [[ "$(pbs_launcher)" == srun ]]; then
    # To the tasks, not to srun: srun answers SIGTERM by cancelling its step with SIGKILL.
    # Bounded, as slurm/ray.sbatch's: while SLURM cancels the job, scancel retries a job "in
    # transition" for up to a minute, which the script's own KillWait would not outlast.
    timeout 5 scancel --signal="${sig}" "${SLURM_JOB_ID}" 2>/dev/null || true
    return 0
  fi
  for pid in "$@"; do kill -s "${sig}" "${pid}" 2>/dev/null || true; done
}

pbs_rerun_check() {
  # PBS keeps the job id across qrerun; a marker per job id tells a rerun from a first start.
  local marker="${WORKDIR}/logs/.pbs-ran-${PBS_JOBID:-0}"
  mkdir -p "${WORKDIR}/logs"
  rm -f "${WORKDIR}/logs/.pbs-status-$(pbs_job_number)-"* # an earlier attempt's (a kill_delay's SIGKILL left them)
  if [[ -e "${marker}" ]]; then
    export RESUME=auto
    log "job ${PBS_JOBID:-0} ran before (qrerun): resuming from the newest checkpoint"
  fi
  : >"${marker}"
  # shellcheck disable=SC2034 # read by the sourcing script, which removes it when the job succeeds
  PBS_RERUN_MARKER="${marker}"
}

# [[H:]M:]S or seconds -> seconds; nothing for anything else.
walltime_seconds() {
  local text="$1" total=0 part
  local -a parts
  [[ "${text}" =~ ^[0-9]+(:[0-9]+){0,2}$ ]] || return 0
  IFS=: read -ra parts <<<"${text}"
  for part in "${parts[@]}"; do total=$((total * 60 + 10#${part})); done
  printf '%s\n' "${total}"
}

pbs_walltime() {
  if [[ -n "${WALLTIME:-}" ]]; then
    walltime_seconds "${WALLTIME}"
  elif [[ -n "${PBS_WALLTIME:-}" ]]; then
    walltime_seconds "${PBS_WALLTIME}"
  elif [[ -n "${PBS_JOBID:-}" ]] && command -v qstat >/dev/null; then
    walltime_seconds "$(timeout 10 qstat -f "${PBS_JOBID}" 2>/dev/null | sed -n 's/^ *Resource_List.walltime = *//p' | head -n 1)"
  fi
}

pbs_stop_before_walltime() {
  local margin="${STOP_BEFORE_WALLTIME:-300}" needed="${1:-0}" what="${2:-the stop}" walltime
  [[ "${margin}" =~ ^[0-9]+$ ]] || {
    log "error: STOP_BEFORE_WALLTIME=${margin} is not a number of seconds (300 by default; 0 turns the stop off)"
    exit 2
  }
  ((margin > 0)) || return 0
  if ((margin < needed)); then # the stop budget: what follows the stop must fit before the walltime
    log "error: STOP_BEFORE_WALLTIME=${margin} s cannot hold the stop it starts, ${needed} s (${what}): raise it, or shorten the stop"
    exit 2
  fi
  walltime="$(pbs_walltime)"
  if [[ -z "${walltime}" ]]; then
    log "note: the job's walltime is unknown (set WALLTIME=H:M:S as in -l walltime): a walltime's stop gives kill_delay alone, no checkpoint"
    return 0
  fi
  if ((walltime <= margin)); then
    log "note: the walltime (${walltime} s) is not longer than STOP_BEFORE_WALLTIME (${margin} s): no stop of the job's own"
    return 0
  fi
  log "the job stops itself ${margin} s before its walltime of ${walltime} s (STOP_BEFORE_WALLTIME), with a checkpoint"
  # In its own process, killed at the script's end (PBS_STOP_TIMER); what it sends is what qdel sends.
  (
    trap 'kill "${nap}" 2>/dev/null; exit 0' TERM # turned off: its sleep goes with it, no process left
    trap '' INT
    sleep "$((walltime - margin))" &
    nap=$!
    wait "${nap}"
    log "the walltime is ${margin} s away: stopping the job with a checkpoint, as qdel would"
    kill -TERM "$$"
  ) &
  PBS_STOP_TIMER=$!
}

pbs_stop_timer_off() {
  [[ -z "${PBS_STOP_TIMER:-}" ]] || kill "${PBS_STOP_TIMER}" 2>/dev/null || true
}
