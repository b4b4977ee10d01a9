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
#
# The wrapper defines log, ray_on_node INDEX COMMAND... (execs COMMAND on that node: srun, pbsdsh
# or ssh; called in the background) and ray_stop_nodes PID... (asks the nodes' commands started
# so to end, SIGTERM), and keeps STOP_SIGNAL (the first stop signal) in its traps.

# shellcheck source=batch/python_env.sh disable=SC1091 # linted on its own
source batch/python_env.sh

RAY_JOB=0
RAY_GPUS_PER_NODE=0
RAY_GPU_SOURCE="none given"
RAY_NODE_NAMES=()
RAY_NODE_HINTS=()

RAY_STEP_PIDS=()
RAY_SUBMIT_PID=""

ray_cluster_init() {
  RAY_JOB="$1" RAY_GPUS_PER_NODE="$2" RAY_GPU_SOURCE="$3"
}

ray_node_add() {
  RAY_NODE_NAMES+=("$1")
  RAY_NODE_HINTS+=("$2")
}

ray_check_config() {
  # The nodes inherit this Python (srun) or get its PATH forwarded (pbs/nodes.sh).
  activate_job_python
  command -v ray >/dev/null || { log "error: no ray on PATH ($(command -v python || echo no python)): pip install -e '.[ray]'"; exit 2; }
  python -m purrsight.launcher.ray_node check-config "$@"
}

ray_cluster_up() {
  local index role names deadline="${RAY_START_TIMEOUT:-600}"
  local -a watch=()
  RAY_LOG_DIR="$(realpath -m "${LOG_DIR:-logs}")/ray-${RAY_JOB}" # each node's log: <node>.log
  mkdir -p "${RAY_LOG_DIR}"
  # A token of this job's own: another user's process on a shared node cannot submit code to this
  # cluster. Each node's command inherits it (srun) or gets it forwarded (RAY_ prefix, pbs/nodes.sh).
  export RAY_AUTH_MODE=token RAY_USAGE_STATS_ENABLED=0
  RAY_AUTH_TOKEN="${RAY_AUTH_TOKEN:-$(python -c 'import secrets; print(secrets.token_hex(16))')}"
  export RAY_AUTH_TOKEN
  # How long `ray job stop` lets the driver and its workers checkpoint before SIGKILL (Ray's default: 3 s).
  export RAY_JOB_STOP_WAIT_TIME_S="${RAY_JOB_STOP_WAIT_TIME_S:-90}"
  RAY_HEAD_ADDR="$(python -m purrsight.launcher.ray_node address --hint "${RAY_NODE_HINTS[0]}")"
  log "Ray over ${#RAY_NODE_NAMES[@]} node(s) ${RAY_NODE_NAMES[*]}; head ${RAY_HEAD_ADDR}; node logs in ${RAY_LOG_DIR}/"
  for index in "${!RAY_NODE_NAMES[@]}"; do
    role="worker"
    ((index > 0)) || role="head"
    ray_on_node "${index}" python -m purrsight.launcher.ray_node start "${role}" --job "${RAY_JOB}" --slot "${index}" \
      --name "${RAY_NODE_NAMES[index]}" --hint "${RAY_NODE_HINTS[index]}" --head "${RAY_HEAD_ADDR}" \
      --gpus "${RAY_GPUS_PER_NODE}" --gpu-source "${RAY_GPU_SOURCE}" \
      >"${RAY_LOG_DIR}/${RAY_NODE_NAMES[index]}.log" 2>&1 &
    RAY_STEP_PIDS+=($!)
    watch+=(--watch "${RAY_NODE_NAMES[index]}=$!")
  done
  names="$(IFS=,; printf '%s' "${RAY_NODE_NAMES[*]}")"
  RAY_DASHBOARD="$(python -m purrsight.launcher.ray_node wait --job "${RAY_JOB}" --head "${RAY_HEAD_ADDR}" \
    --nodes "${names}" --gpus-per-node "${RAY_GPUS_PER_NODE}" --deadline "${deadline}" --log-dir "${RAY_LOG_DIR}" \
    "${watch[@]}")"
}

# shellcheck disable=SC2317 # invoked by the wrappers' traps
ray_stop_training() {
  log "received SIG$1: stopping the training (every worker saves a checkpoint)"
  # The submit wrapper answers its first SIGTERM as `ray job stop` does: every worker saves a
  # checkpoint, and it waits for the job's end.
  if [[ -n "${RAY_SUBMIT_PID}" ]]; then kill -s TERM "${RAY_SUBMIT_PID}" 2>/dev/null || true; fi
}

ray_run() {
  local rc=0
  ray_check_config "$@" || rc=$?
  ((rc != 0)) || ray_cluster_up || rc=$?
  if ((rc == 0)) && [[ -z "${STOP_SIGNAL:-}" ]]; then
    ray_train "$@" || rc=$?
  elif ((rc == 0)); then
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
  local pid deadline=$((SECONDS + 60))
  ((${#RAY_STEP_PIDS[@]})) || return 0
  log "stopping this job's Ray on every node"
  ray_stop_nodes "${RAY_STEP_PIDS[@]}"
  for pid in "${RAY_STEP_PIDS[@]}"; do
    while kill -0 "${pid}" 2>/dev/null && ((SECONDS < deadline)); do sleep 1; done
    kill -s KILL "${pid}" 2>/dev/null || true
    wait "${pid}" 2>/dev/null || true
  done
  RAY_STEP_PIDS=()
}
