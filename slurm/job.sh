# shellcheck shell=bash
# slurm/job.sh: what slurm/train.sbatch and slurm/ray.sbatch share, sourced by both (after
# `cd "${SLURM_SUBMIT_DIR}"`): the allocation's node addresses, and the run's end.
#
#   node_address NODE        the node's address as SLURM reaches it (NodeAddr), else DNS
#   scontrol_field KEY ARGS  KEY's value in `scontrol ARGS -o`; empty when scontrol fails
#   gpus_per_node            the GPUs SLURM gave each node ("a100:8" -> 8; 0 when none or unreadable)
#   step_cpus INDEX|all      --cpus-per-task for a one-task step on node INDEX of the allocation (or
#                            one on every node): srun no longer inherits it (SLURM 22.05), and under CPU
#                            binding a step without it gets one CPU
#   requeue_setup            before the run: the run's counters, RESUME=auto after a requeue
#   stop_budget NEEDED_S WHAT  before the run: the time a stop takes (NEEDED_S, made of WHAT)
#                            against what SLURM leaves it. USR1's lead before the time limit
#                            (USR1_LEAD_S, else the script's own `#SBATCH --signal` line) must
#                            hold it: else exit 2, nothing started. A scancel leaves KillWait, a
#                            preemption the partition's GraceTime + KillWait: said in a note when short
#   on_stop_signal SIG       the traps' part: record the first stop signal, call stop_run
#   stop_signals_recorded    after the run: a stop signal is only recorded (nothing left to stop)
#   finish_run RC STARTED    after the run: end, or requeue (excluding bad nodes), as docs/SCHEDULERS.md says
#
# The sourcing script defines log() and stop_run() (how its run is told to checkpoint and stop).

# Exit codes of a run that a requeue would only repeat: usage/config error, health check.
readonly NO_REQUEUE_CODES=" 2 3 "

STOP_SIGNAL=""

# The value of KEY in `scontrol ARGS -o`'s one-line KEY=VALUE output; empty when scontrol is
# missing or fails (under pipefail a failing scontrol would otherwise end the sourcing script).
scontrol_field() {
  local key="$1"
  shift
  { scontrol "$@" 2>/dev/null || true; } | tr ' ' '\n' | sed -n "s/^${key}=//p" | head -n 1
}

node_address() {
  local addr
  addr="$(scontrol_field NodeAddr show node "$1" -o)"
  [[ -n "${addr}" && "${addr}" != "$1" ]] || addr="$(getent ahosts "$1" | awk 'NR == 1 { print $1 }')"
  printf '%s\n' "${addr:-$1}"
}

gpus_per_node() {
  local gpus="${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}"
  gpus="${gpus##*:}"
  [[ "${gpus}" =~ ^[0-9]+$ ]] || gpus=0
  printf '%s\n' "${gpus}"
}

step_cpus() {
  local index="$1" entry count times expanded=()
  if [[ "${SLURM_CPUS_PER_TASK:-}" =~ ^[1-9][0-9]*$ ]]; then
    printf '%s\n' "${SLURM_CPUS_PER_TASK}"
    return 0
  fi
  # SLURM_JOB_CPUS_PER_NODE: "32(x2),16" is 32, 32, 16 in node order.
  local IFS=,
  for entry in ${SLURM_JOB_CPUS_PER_NODE:-1}; do
    count="${entry%%(*}" times=1
    [[ "${entry}" == *"(x"* ]] && times="${entry##*(x}" times="${times%)}"
    while ((times-- > 0)); do expanded+=("${count}"); done
  done
  if [[ "${index}" != all ]]; then
    printf '%s\n' "${expanded[index]:-${expanded[0]}}"
  else
    printf '%s\n' "$(printf '%s\n' "${expanded[@]}" | sort -n | head -n 1)" # the least: one count for every node's task
  fi
}

requeue_setup() {
  RESTARTS="${SLURM_RESTART_COUNT:-0}"
  COUNTER="logs/.requeue-${SLURM_CLUSTER_NAME:-slurm}-${SLURM_JOB_ID:-0}"
  ((RESTARTS > 0)) || rm -f "${COUNTER}" # a job's first run starts a fresh count (job ids can repeat)
  BAD_NODES="${PWD}/logs/.bad-nodes-${SLURM_CLUSTER_NAME:-slurm}-${SLURM_JOB_ID:-0}"
  mkdir -p logs
  rm -f "${BAD_NODES}" # each run names its own failing nodes
  export PURRSIGHT_BAD_NODES_FILE="${BAD_NODES}"
  if ((RESTARTS > 0)); then
    export RESUME=auto # continue from the newest checkpoint of the run
    log "run ${RESTARTS} after a requeue: resuming from the newest checkpoint"
  fi
}

# The seconds before the time limit at which the script's own last `#SBATCH --signal` line (the
# last wins, as in sbatch) sends USR1 to this batch script: `B:` (or `RB:`) and USR1 or 10, `@N`
# (SLURM's default lead without it: 60 s). Empty when it sends none to the script; "steps" when it
# sends USR1 to the job's steps only (no B:), where no trap of ours hears it. A --signal given on the
# sbatch command line is not in the script: USR1_LEAD_S names it then.
usr1_lead() {
  if [[ -n "${USR1_LEAD_S:-}" ]]; then
    printf '%s\n' "${USR1_LEAD_S}"
    return 0
  fi
  local line value
  [[ -r "$0" ]] || return 0
  line="$(grep -E '^#SBATCH[[:space:]]+--signal[=[:space:]]' "$0" | tail -n 1)" || return 0
  value="${line#*--signal}"
  value="${value#"${value%%[![:space:]=]*}"}"
  value="${value%%[[:space:]#]*}"
  if [[ "${value}" =~ ^R?BR?:(SIG)?(USR1|10)(@([0-9]+))?$ ]]; then
    printf '%s\n' "${BASH_REMATCH[4]:-60}"
  elif [[ "${value}" =~ (USR1|10)(@[0-9]+)?$ ]]; then
    printf 'steps\n'
  fi
}

stop_budget() {
  local needed="$1" what="$2" lead kill_wait grace
  lead="$(usr1_lead)"
  if [[ "${lead}" == steps ]]; then
    log "note: the script's --signal sends USR1 to the job's steps, not to this script (no B:): the time limit stops the run without a checkpoint; use --signal=B:USR1@$((needed + 30))"
    lead=""
  elif [[ -n "${lead}" && ! "${lead}" =~ ^(0|[1-9][0-9]*)$ ]]; then
    log "error: USR1_LEAD_S=${lead} is not a number of seconds (the N of sbatch --signal=B:USR1@N)"
    exit 2
  elif [[ -z "${lead}" ]]; then
    log "note: no USR1 before the time limit (sbatch --signal=B:USR1@N): the time limit stops the run without a checkpoint"
  fi
  # The requeue must come before the time limit: after it, SLURM ends the job as TIMEOUT.
  if [[ -n "${lead}" ]] && ((lead < needed)); then
    log "error: USR1 comes ${lead} s before the time limit, and the stop it starts takes up to ${needed} s (${what}): submit with --signal=B:USR1@$((needed + 30)) (and USR1_LEAD_S=$((needed + 30)) when it is on the command line), or shorten the stop"
    exit 2
  fi
  # `show config` prints "KillWait = 60 sec", not KEY=VALUE.
  kill_wait="$({ scontrol show config 2>/dev/null || true; } | sed -n 's/^KillWait *= *\([0-9]*\) sec.*/\1/p')"
  [[ -n "${kill_wait}" ]] || return 0
  grace="$(scontrol_field GraceTime show partition "${SLURM_JOB_PARTITION:-}" -o)"
  [[ "${grace}" =~ ^[0-9]+$ ]] || grace=0
  # A scancel leaves KillWait; a preemption GraceTime (the partition's; a QOS may set its own), then KillWait.
  if ((kill_wait < needed || kill_wait + grace < needed)); then
    log "note: a scancel leaves the stop KillWait (${kill_wait} s), a preemption GraceTime + KillWait ($((grace + kill_wait)) s), before SIGKILL; the stop takes up to ${needed} s (${what}): a checkpoint that takes longer is cut short; USR1 leaves ${lead:-0} s"
  fi
}

# shellcheck disable=SC2317 # invoked by the traps of the sourcing script
on_stop_signal() {
  # The first stop signal decides: the time limit's SIGTERM after our USR1 must not undo the requeue.
  STOP_SIGNAL="${STOP_SIGNAL:-$1}"
  stop_run "$1"
}

# After the run, until the script ends: a USR1 or TERM only records itself (the first decides).
# Default handling there would kill the script between the run's end and its requeue: the time
# limit's SIGTERM, arriving during the Ray teardown after USR1's stop, ended a job that was to
# requeue, and finish_run never logged its end.
stop_signals_recorded() {
  trap 'STOP_SIGNAL="${STOP_SIGNAL:-USR1}"' USR1
  trap 'STOP_SIGNAL="${STOP_SIGNAL:-TERM}"' TERM
}

# Consecutive runs that ended within REQUEUE_MIN_RUNTIME seconds: a job that fails right
# after every start must not requeue forever.
quick_failures() {
  local file="$1" runtime="$2" count=0
  [[ -f "${file}" ]] && count="$(<"${file}")"
  if ((runtime < ${REQUEUE_MIN_RUNTIME:-300})); then count=$((count + 1)); else count=0; fi
  printf '%s\n' "${count}" >"${file}"
  printf '%s\n' "${count}"
}

# The nodes that failed their own checks this run (each names itself in the file:
# purrsight/launcher/health.py, purrsight/ray_node/wait.py), and those an elastic job lost
# (slurm/train.sbatch, "lost mid-run"), join the job's exclude list, into
# EXCLUDE_LIST. Not when every node failed (then the fault is the job's: config, data) or
# beyond MAX_EXCLUDED_NODES.
exclude_bad_nodes() {
  local file="$1" current node checks
  local -a allocated bad excluded
  [[ -s "${file}" ]] || return 1
  mapfile -t allocated < <(scontrol show hostnames "${SLURM_JOB_NODELIST}")
  mapfile -t bad < <(cut -f1 "${file}" | sort -u)
  if ((${#bad[@]} >= ${#allocated[@]})); then
    log "every node failed its checks: the fault is the job's (config, data), not a node's"
    return 1
  fi
  current="$(scontrol_field ExcNodeList show job "${SLURM_JOB_ID}" -o)"
  [[ "${current}" == "(null)" ]] && current=""
  mapfile -t excluded < <({ [[ -z "${current}" ]] || scontrol show hostnames "${current}"; printf '%s\n' "${bad[@]}"; } | sort -u)
  if ((${#excluded[@]} > ${MAX_EXCLUDED_NODES:-4})); then
    log "not excluding ${bad[*]}: the job would exclude ${#excluded[@]} nodes (MAX_EXCLUDED_NODES=${MAX_EXCLUDED_NODES:-4})"
    return 1
  fi
  while IFS=$'\t' read -r node checks; do
    if [[ "${checks}" == lost* ]]; then # written by an elastic job's wrapper (batch/elastic.sh)
      log "node ${node} was ${checks}: excluding it from this job"
    else
      log "node ${node} failed its health checks (${checks}): excluding it from this job"
    fi
  done <"${file}"
  EXCLUDE_LIST="$(IFS=,; printf '%s' "${excluded[*]}")"
}

# Requeue with EXCLUDE_LIST excluded. SLURM refuses a running job's exclude list, so it is set
# once the job is requeued; the requeue sends this script SIGTERM, ignored so it lives to do it
# (SLURM kills it after KillWait at the latest).
requeue_excluding() {
  local attempt
  trap '' TERM
  scontrol requeue "${SLURM_JOB_ID}"
  for attempt in 1 2 3 4 5 6 7 8 9 10; do
    scontrol update JobId="${SLURM_JOB_ID}" ExcNodeList="${EXCLUDE_LIST}" 2>/dev/null && return 0
    sleep "${attempt}"
  done
  log "could not set the job's exclude list to ${EXCLUDE_LIST}: the requeued job may get those nodes again"
}

# Ends the job without a requeue: the next submission starts a fresh quick-failure count.
end_without_requeue() {
  local rc="$1" message="$2"
  rm -f "${COUNTER}"
  log "${message}"
  exit "${rc}"
}

finish_run() {
  local rc="$1" started="$2"
  if ((rc == 0)); then end_without_requeue 0 "training finished"; fi
  # SIGTERM alone is scancel, or a preemption that SLURM's PreemptMode handles (REQUEUE requeues
  # the job itself). SLURM shows a cancelled job as COMPLETING, indistinguishable from other
  # endings, and `scontrol requeue` would bring it back: so only USR1 (time limit, or preemption
  # with PreemptParameters=send_user_signal) and failures requeue. Checked before the exclusions:
  # a cancelled job stays cancelled, whatever nodes its run lost or found bad.
  if [[ "${STOP_SIGNAL}" == TERM ]]; then
    end_without_requeue "${rc}" "stopped by SIGTERM (scancel or preemption): not requeueing; the checkpoints are kept"
  fi
  if ((RESTARTS < ${MAX_REQUEUES:-20})) && exclude_bad_nodes "${BAD_NODES}"; then
    rm -f "${BAD_NODES}"
    log "requeueing without ${EXCLUDE_LIST}; the next run resumes"
    requeue_excluding
    exit "${rc}"
  fi
  if [[ "${NO_REQUEUE_CODES}" == *" ${rc} "* ]]; then
    end_without_requeue "${rc}" "exit code ${rc} (bad input or a failed check): not requeueing"
  fi
  local quick
  quick="$(quick_failures "${COUNTER}" "$(($(date +%s) - started))")"
  if ((quick >= ${MAX_QUICK_REQUEUES:-3})); then
    end_without_requeue "${rc}" "not requeueing: ${quick} runs in a row ended within ${REQUEUE_MIN_RUNTIME:-300} s (MAX_QUICK_REQUEUES)"
  fi
  if ((RESTARTS >= ${MAX_REQUEUES:-20})); then
    end_without_requeue "${rc}" "not requeueing: already requeued ${RESTARTS} times (MAX_REQUEUES)"
  fi
  log "run ended with code ${rc}${STOP_SIGNAL:+ after SIG${STOP_SIGNAL}}: requeueing; the next run resumes"
  scontrol requeue "${SLURM_JOB_ID}" # SLURM starts the job again later; its SIGTERM to this script is only recorded now
  exit "${rc}"
}
