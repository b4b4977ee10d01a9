# shellcheck shell=bash
# batch/ray_cluster.sh: a Ray cluster inside a batch job, and the training on it. The
# scheduler-independent half of slurm/ray.sbatch and pbs/ray.pbs, sourced by both from the
# job's working folder (docs/SCHEDULERS.md, "Ray inside a batch job").
#
#   ray_cluster_init JOB GPUS GPU_SOURCE   the job id (ports, temp dirs, log folder follow from it)
#                            and the GPUs of each node (and where that number comes from)
#   ray_node_add NAME HINT   a node, in order (the first is the head), with the scheduler's
#                            address or host name for it
#   ray_run CONFIG [k=v]     the config checked (exit 2), this job's Ray up on every node with a
#                            deadline (exit 3 naming a missing node), then the training through
#                            purrsight.ray_engine.submit; its exit code is the driver's
#   ray_stop_training SIG    the traps' part: the training stops, every worker checkpointing
#   ray_cluster_down         this job's Ray stopped on every node, nothing else of the node's
#   ray_stop_wait            the driver's stop wait (RAY_JOB_STOP_WAIT_TIME_S), checked: status 2 if no number
#
# The wrapper defines log, ray_on_node INDEX COMMAND... (execs COMMAND on that node: srun, pbsdsh
# or ssh; called in the background) and ray_stop_nodes PID... (asks the nodes' commands started
# so to tear their Ray down: SIGUSR2), and keeps STOP_SIGNAL (the first stop signal) in its traps.
#
# The stop budget. A stop (USR1 before the time limit, a scancel, a preemption, qdel) ends with
# a checkpoint when what follows it fits before the scheduler's SIGKILL:
#   the driver's stop: every worker finishes its step and writes its checkpoint,
#     at most RAY_JOB_STOP_WAIT_TIME_S (180 s; then the job server kills the driver)
#   + the teardown: every node's Ray process tree killed, RAY_TEARDOWN_S at most (20 s)
#   + the requeue and the script's end (slurm/ray.sbatch counts 10 s)
#   = 210 s at worst: slurm/ray.sbatch's --signal=B:USR1@240 leaves 30 s to spare, and the script
# refuses a lead that cannot hold it (slurm/job.sh stop_budget). A scancel or a preemption gives the
# site's KillWait (and GraceTime) instead: the script notes it at start when it is shorter.
# Ray's processes outlive the job-wide SIGTERM (purrsight/ray_node/node.py holds it for them)
# until ray_cluster_down, so that the driver has that time.

# shellcheck source=batch/python_env.sh disable=SC1091 # linted on its own
source batch/python_env.sh

readonly RAY_STOP_WAIT_DEFAULT=180 # what one step and a checkpoint write may take at real size
readonly RAY_TEARDOWN_S=20         # every node's process tree killed (SIGKILL: no grace needed after the stop)

RAY_JOB=0
RAY_GPUS_PER_NODE=0
RAY_GPU_SOURCE="none given"
RAY_NODE_NAMES=()
RAY_NODE_HINTS=()

RAY_STEP_PIDS=()
RAY_SUBMIT_PID=""
RAY_WAIT_PID=""
RAY_LOG_DIR=""

# The driver's stop wait in seconds (RAY_JOB_STOP_WAIT_TIME_S, RAY_STOP_WAIT_DEFAULT when unset),
# for the stop budget; a value that is no number of seconds: its error on stderr, status 2.
ray_stop_wait() {
  local wait="${RAY_JOB_STOP_WAIT_TIME_S:-${RAY_STOP_WAIT_DEFAULT}}"
  if [[ ! "${wait}" =~ ^(0|[1-9][0-9]*)$ ]]; then
    log "error: RAY_JOB_STOP_WAIT_TIME_S=${wait} is not a number of seconds (${RAY_STOP_WAIT_DEFAULT} by default)" >&2
    return 2
  fi
  printf '%s\n' "${wait}"
}

ray_cluster_init() {
  RAY_JOB="$1" RAY_GPUS_PER_NODE="$2" RAY_GPU_SOURCE="$3"
}

ray_node_add() {
  RAY_NODE_NAMES+=("$1")
  RAY_NODE_HINTS+=("$2")
}

# Every step below is checked by hand (|| return): ray_run calls these in `||` lists, where
# bash turns `set -e` off for the whole call.
ray_check_config() {
  # The nodes inherit this Python (srun) or get its PATH forwarded (pbs/nodes.sh).
  activate_job_python
  command -v ray >/dev/null || { log "error: no ray on PATH ($(command -v python || echo no python)): pip install -e '.[ray]'"; return 2; }
  python -m purrsight.ray_node check-config "$@"
}

# A token of this job's own, in a file only this user can read: another user's process on a
# shared node cannot submit code to this cluster, and the token is on no command line and in no
# environment that a launcher passes on as arguments (`env NAME=VALUE` under pbsdsh or ssh).
# Ray reads RAY_AUTH_TOKEN_PATH on every node (the job's folder is on storage they all mount).
ray_make_token() {
  local token_file="${RAY_LOG_DIR}/.auth-token"
  (
    umask 077
    if [[ -n "${RAY_AUTH_TOKEN:-}" ]]; then
      printf '%s' "${RAY_AUTH_TOKEN}" >"${token_file}"
    else
      python -c 'import secrets; print(secrets.token_hex(16), end="")' >"${token_file}"
    fi
  ) || { log "error: cannot write this job's Ray token to ${token_file}"; return 2; }
  unset RAY_AUTH_TOKEN
  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="${token_file}"
}

ray_cluster_up() {
  local index role names head ports deadline="${RAY_START_TIMEOUT:-600}"
  local -a watch=()
  RAY_LOG_DIR="$(realpath -m "${LOG_DIR:-logs}")/ray-${RAY_JOB}" # each node's log: <node>.log
  mkdir -p "${RAY_LOG_DIR}" || return 2
  rm -f "${RAY_LOG_DIR}/.teardown" "${RAY_LOG_DIR}"/*.ended "${RAY_LOG_DIR}"/*.down # a requeued run's own
  ray_make_token || return
  export RAY_USAGE_STATS_ENABLED=0
  # How long `ray job stop` lets the driver and its workers checkpoint before SIGKILL (Ray's default: 3 s).
  export RAY_JOB_STOP_WAIT_TIME_S="${RAY_JOB_STOP_WAIT_TIME_S:-${RAY_STOP_WAIT_DEFAULT}}"
  head="$(python -m purrsight.ray_node address --hint "${RAY_NODE_HINTS[0]}")" || { log "error: no address for the head ${RAY_NODE_NAMES[0]}"; return 3; }
  [[ -n "${head}" ]] || { log "error: no address for the head ${RAY_NODE_NAMES[0]}"; return 3; }
  # This script runs on the first node, the head's: its ports are probed here, before any Ray starts.
  ports="$(python -m purrsight.ray_node ports --job "${RAY_JOB}")" || return 1
  log "Ray over ${#RAY_NODE_NAMES[@]} node(s) ${RAY_NODE_NAMES[*]}; head ${head}; ports ${ports}-$((ports + 99)); node logs in ${RAY_LOG_DIR}/"
  for index in "${!RAY_NODE_NAMES[@]}"; do
    role="worker"
    ((index > 0)) || role="head"
    ray_on_node "${index}" python -m purrsight.ray_node start "${role}" --job "${RAY_JOB}" --ports "${ports}" \
      --slot "${index}" --name "${RAY_NODE_NAMES[index]}" --hint "${RAY_NODE_HINTS[index]}" --head "${head}" \
      --gpus "${RAY_GPUS_PER_NODE}" --gpu-source "${RAY_GPU_SOURCE}" --log-dir "${RAY_LOG_DIR}" \
      --teardown-file "${RAY_LOG_DIR}/.teardown" --stop-grace "$((RAY_JOB_STOP_WAIT_TIME_S + RAY_TEARDOWN_S))" \
      >>"${RAY_LOG_DIR}/${RAY_NODE_NAMES[index]}.log" 2>&1 & # appended: a requeued run keeps the first's
    RAY_STEP_PIDS+=($!)
    watch+=(--watch "${RAY_NODE_NAMES[index]}=$!")
  done
  names="$(IFS=,; printf '%s' "${RAY_NODE_NAMES[*]}")"
  # In the background, then `wait`: bash runs no trap until a command substitution ends, and a
  # stop during the bring-up must not wait out RAY_START_TIMEOUT.
  python -m purrsight.ray_node wait --ports "${ports}" --head "${head}" --nodes "${names}" \
    --gpus-per-node "${RAY_GPUS_PER_NODE}" --deadline "${deadline}" --log-dir "${RAY_LOG_DIR}" "${watch[@]}" \
    >"${RAY_LOG_DIR}/.dashboard" &
  RAY_WAIT_PID=$!
  local rc=0
  while :; do
    wait "${RAY_WAIT_PID}" && rc=0 || rc=$?
    kill -0 "${RAY_WAIT_PID}" 2>/dev/null || break # a trapped signal ends `wait` early
    if [[ -n "${STOP_SIGNAL:-}" ]]; then
      kill -s TERM "${RAY_WAIT_PID}" 2>/dev/null || true
      wait "${RAY_WAIT_PID}" 2>/dev/null || true
      rc=143
      break
    fi
  done
  RAY_WAIT_PID=""
  ((rc == 0)) || return "${rc}"
  RAY_DASHBOARD="$(<"${RAY_LOG_DIR}/.dashboard")"
  [[ -n "${RAY_DASHBOARD}" ]] || { log "error: the wait for the nodes named no job server"; return 3; }
}

# shellcheck disable=SC2317 # invoked by the wrappers' traps
ray_stop_training() {
  log "received SIG$1: stopping the training (every worker saves a checkpoint)"
  # The submit wrapper answers SIGTERM as `ray job stop` does: every worker saves a checkpoint,
  # and it waits for the job's end, whatever signals follow (the time limit's, a scancel's).
  if [[ -n "${RAY_SUBMIT_PID}" ]]; then kill -s TERM "${RAY_SUBMIT_PID}" 2>/dev/null || true; fi
}

ray_run() {
  local rc=0
  ray_check_config "$@" || rc=$?
  ((rc != 0)) || ray_cluster_up || rc=$?
  if ((rc == 0)) && [[ -z "${STOP_SIGNAL:-}" ]]; then
    ray_train "$@" || rc=$?
  elif ((rc == 0 || rc == 143)) && [[ -n "${STOP_SIGNAL:-}" ]]; then
    rc=143 # stopped while the cluster came up: nothing trained, nothing to checkpoint
  fi
  return "${rc}"
}

ray_train() {
  local config="$1" rc=0
  shift
  local workers=$((${#RAY_NODE_NAMES[@]} * (RAY_GPUS_PER_NODE > 0 ? RAY_GPUS_PER_NODE : 1)))
  local -a submit=(python -m purrsight.ray_engine.submit --address "${RAY_DASHBOARD}" --working-dir .)
  if [[ "${RESUME:-}" == auto ]]; then
    submit+=(--runtime-env-json '{"env_vars": {"PURRSIGHT_RESUME": "auto"}}')
  fi
  # One worker per GPU of the allocation (one per node without GPUs: spread, one a node), and the
  # job's folder as the storage every node mounts; the user's overrides come after and win.
  local -a sizing=("ray.num_workers=${workers}")
  ((RAY_GPUS_PER_NODE > 0)) || sizing+=(ray.placement_strategy=SPREAD)
  submit+=(-- --config "${config}" "${sizing[@]}" "ray.shared_dir=${PWD}" "$@")
  log "training: ${submit[*]}"
  "${submit[@]}" &
  RAY_SUBMIT_PID=$!
  while :; do
    wait "${RAY_SUBMIT_PID}" && rc=0 || rc=$?
    kill -0 "${RAY_SUBMIT_PID}" 2>/dev/null || break # wait returns early when a trapped signal arrives
  done
  RAY_SUBMIT_PID=""
  return "${rc}"
}

ray_cluster_down() {
  local pid index name deadline=$((SECONDS + RAY_TEARDOWN_S))
  local -a silent=()
  if [[ -n "${RAY_WAIT_PID}" ]]; then kill -s TERM "${RAY_WAIT_PID}" 2>/dev/null || true; fi
  if [[ -n "${RAY_LOG_DIR}" ]]; then rm -f "${RAY_LOG_DIR}/.auth-token" "${RAY_LOG_DIR}/.dashboard"; fi
  ((${#RAY_STEP_PIDS[@]})) || return 0
  log "stopping this job's Ray on every node"
  # The file reaches every launcher's task (pbsdsh and ssh forward no USR2); each node answers
  # with <node>.down once its Ray is down. A step whose local client ended without that answer
  # (a node that died) may still have its task running over there; where the client's end says
  # nothing of the task's (RAY_TASK_OUTLIVES_CLIENT=1: pbsdsh, which exits once it has forwarded a
  # signal; an ssh client, which the job's SIGTERM ends), the answer is awaited as long as the
  # teardown's time allows.
  : >"${RAY_LOG_DIR}/.teardown"
  ray_stop_nodes "${RAY_STEP_PIDS[@]}"
  for index in "${!RAY_STEP_PIDS[@]}"; do
    name="${RAY_NODE_NAMES[index]}" pid="${RAY_STEP_PIDS[index]}"
    while [[ ! -e "${RAY_LOG_DIR}/${name}.down" ]] && ((SECONDS < deadline)); do
      [[ "${RAY_TASK_OUTLIVES_CLIENT:-0}" == 1 ]] || kill -0 "${pid}" 2>/dev/null || break
      sleep 0.5
    done
    [[ -e "${RAY_LOG_DIR}/${name}.down" ]] || silent+=("${name}")
  done
  for pid in "${RAY_STEP_PIDS[@]}"; do
    while kill -0 "${pid}" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.5; done
    kill -s KILL "${pid}" 2>/dev/null || true
    wait "${pid}" 2>/dev/null || true
  done
  RAY_STEP_PIDS=()
  if ((${#silent[@]})); then
    # Kept: a node that has not seen it yet still may (a shared filesystem's cache); the next
    # bring-up of this job removes it.
    log "warning: no answer to the teardown from ${silent[*]} (their step ended without one, or ${RAY_TEARDOWN_S} s passed); ${RAY_LOG_DIR}/.teardown is kept for them"
  else
    rm -f "${RAY_LOG_DIR}/.teardown"
  fi
}
