#!/usr/bin/env bash
# cluster_train.sh: set this node up and start its share of a PurrSight Phase 2 training job.
#
# One invocation per node. It validates its arguments, activates the Python environment, runs
# one Python step (purrsight/launcher/node_plan.py: probe, config, placement, run folder,
# NCCL/socket settings, health checks) whose plan it sources, starts the node log, and runs
# torchrun, which joins every node into one job at MASTER_ADDR:MASTER_PORT and restarts the
# workers on all nodes (from the newest checkpoint) when one of them dies.
# Everything this node prints also lands in LOG_DIR/cluster_train_<TIME>_node<RANK>.log.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly SCRIPT_DIR
# Exit codes: the same numbers and meanings as purrsight/errors.py (tests/unit/test_exit_codes.py).
readonly EXIT_USAGE=2
readonly EXIT_HEALTH=3

usage() {
  cat <<'EOF'
Usage: ./cluster_train.sh [config_path] [num_nodes] [node_rank] [master_addr] [master_port] [-- key=value ...]
       ./cluster_train.sh --help | --dry-run [args...]

Start this node's part of a PurrSight Phase 2 training job (one call per node).

Arguments (positional, defaults in brackets):
  config_path   training config YAML                       [config/train_config.yaml]
  num_nodes     nodes in the job: N, or MIN:MAX (elastic)  [1]
                MIN:MAX starts once MIN nodes have joined, admits up to MAX, and goes on
                while MIN remain: a lost node restarts the rest from the last checkpoint at
                the exact data position (trainer.global_batch_size keeps the global batch);
                a node back (started again with RESUME=auto) joins at the others' next step
                end, with a checkpoint there
  node_rank     this node, 0 .. N-1 (or MAX-1); 0 is master and hosts the rendezvous [0]
  master_addr   address of node 0, reachable from all      [localhost]
  master_port   free TCP port on node 0 for the rendezvous [29500]
  -- k=v ...    config overrides for the trainer, e.g. -- trainer.max_steps=100

Options:
  --help        this text
  --dry-run     print the environment it would export and the torchrun command; start nothing

Environment variables (default in brackets; a variable you export yourself is never overridden):
  NPROC_PER_NODE  processes on this node [auto: visible GPUs, honouring CUDA_VISIBLE_DEVICES; 1 without]
  BACKEND         nccl | gloo [auto: the config's distributed.backend; auto there: nccl with GPUs, gloo
                  without]. gloo runs on CPU, also on a GPU node (add -- trainer.accelerator=gpu for
                  gloo on GPUs). The workers get this decision as PURRSIGHT_ACCELERATOR/PURRSIGHT_BACKEND.
  LOG_LEVEL       INFO | DEBUG [INFO]; DEBUG adds NCCL_DEBUG=INFO, TORCH_DISTRIBUTED_DEBUG=DETAIL,
                  shell tracing and tracebacks into the log
  VENV            virtualenv folder to activate [unset]
  CONDA_ENV       conda environment to activate when VENV is unset [unset]
                  With neither set: the .venv beside this script (the README's install) when present,
                  else the conda env purrsight when conda has it, else the python on PATH.
  LOG_DIR         node logs [logs/distributed_training]
  LOG_RANKS       local ranks shown on the console: 0 | 0,1 | all [0]; the log file holds all
  LOG_MAX_BYTES   rotate the node log at this size [104857600]
  LOG_BACKUPS     rotated files kept per run [5]
  LOG_KEEP_RUNS   runs kept per node; older logs are deleted [10]
  MAX_RESTARTS    worker restarts (on every node) before the job fails [3]
  RDZV_TIMEOUT    seconds to wait for all nodes (and, on workers, for the master) [900]
  RDZV_STORE_TIMEOUT  seconds one request to the rendezvous store on node 0 may take [60; a fixed
                  count: RDZV_TIMEOUT]: a node cut off from it gives up after this (Linux)
  RDZV_LAST_CALL_S  elastic jobs: seconds the rendezvous waits for more nodes once MIN have
                  joined [2]; a dead node is dropped after 3 missed heartbeats of 1 s. Nodes that
                  start further apart: raise it (a late node costs every worker a restart)
  MONITOR_INTERVAL  seconds between torchrun's checks of its workers and of nodes waiting to join [1];
                  each check also queries the rendezvous store on node 0 (docs/SCALING.md)
  WORKER_START    forkserver | subprocess: how torchrun starts each worker [forkserver: forked from a
                  server that imports the trainer once per node, during the rendezvous, and serves every
                  restart; subprocess: a fresh interpreter per worker, torchrun's default]
  RDZV_ID         job id shared by all nodes [purrsight-<master_port>, or the SLURM/PBS job id]
  PURRSIGHT_LAUNCH_TIME  Unix time this attempt was launched, for the effective-time report
                  [this script's start; slurm/train.sbatch sets its own start]
  HEALTH_CHECKS   1 | 0: run the health checks before training [1]
  HEALTH_MIN_FREE_GB  free disk required in the run and log folders [1]
  NCCL_PRESET     auto | ib | ethernet | none [auto: InfiniBand when an active port exists]
  NODE_ADDR       this node's address as the other nodes reach it [auto: source of the route to the master]
  RESUME          auto: continue from the newest checkpoint of the run when one exists [unset: start
                  fresh unless torchrun restarted the workers]; the SLURM wrapper sets it after a requeue.
                  Unset, a run folder that already holds a run is refused (exit 2): resume it, pick
                  another run.name, or set run.if_exists=archive|overwrite after --

Examples:
  ./cluster_train.sh                                              # one node, the embedded default
  ./cluster_train.sh config/qwen2.5-0.5b.yaml 2 0 10.0.0.1 29500  # on node 0 of 2
  ./cluster_train.sh config/qwen2.5-0.5b.yaml 2 1 10.0.0.1 29500  # on node 1 of 2
  ./cluster_train.sh config/qwen2.5-0.5b.yaml 2:3 2 10.0.0.1 29500 -- trainer.global_batch_size=192
                                                   # node 2 of an elastic job: 2 to 3 nodes
  NPROC_PER_NODE=2 BACKEND=gloo ./cluster_train.sh config/train_config.yaml -- trainer.max_steps=20
  sbatch slurm/train.sbatch config/qwen2.5-0.5b.yaml              # SLURM: one launcher per node
  qsub pbs/train.pbs                                              # PBS/Torque: one launcher per node

Exit codes (the same as the trainer's; torchrun's own 1 is replaced by the workers' reason):
  0    training finished
  1    an unexpected failure (a bug): the traceback is in the log; or a peer process lost (one line names it)
  2    bad argument, config, data, checkpoint or environment (one line says which)
  3    the cluster failed a check: health checks, preflight all-reduce, Ray cluster too small or absent
  86   the progress watchdog: a rank made no progress for distributed.progress_timeout_s
  128+N  stopped by signal N after saving a checkpoint (143: SIGTERM, 130: SIGINT); resume to continue
EOF
}

log() { printf '%s [cluster_train] %s\n' "$(date '+%Y-%m-%d %H:%M:%S')" "$*" >&2; }

# Microseconds since the epoch: bash 5's clock, or date's on bash 4 (RHEL 8).
now_us() {
  local now="${EPOCHREALTIME:-$(date +%s.%6N)}"
  printf '%s' "${now//[.,]/}"
}

# Seconds since an earlier $(now_us), to the hundredth.
seconds_since() {
  local hundredths=$((($(now_us) - $1) / 10000))
  printf '%d.%02d' $((hundredths / 100)) $((hundredths % 100))
}

# A user mistake: one line naming it, a hint, exit 2.
die_usage() {
  printf '%s [cluster_train] error: %s\n' "$(date '+%Y-%m-%d %H:%M:%S')" "$1" >&2
  printf "Try './cluster_train.sh --help'.\n" >&2
  exit "${EXIT_USAGE}"
}

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

# ------------------------------------------------------------------ arguments

DRY_RUN=0
POSITIONAL=()
OVERRIDES=()

parse_args() {
  while (($#)); do
    case "$1" in
      -h | --help) usage; exit 0 ;;
      --dry-run) DRY_RUN=1 ;;
      --) shift; OVERRIDES=("$@"); break ;;
      -[0-9]*) POSITIONAL+=("$1") ;; # a negative number is a bad argument value, named by validate_args
      -*) die_usage "unknown option $1" ;;
      *) POSITIONAL+=("$1") ;;
    esac
    shift
  done
  ((${#POSITIONAL[@]} <= 5)) || die_usage "too many arguments (${#POSITIONAL[@]}); overrides go after --"
  CONFIG="${POSITIONAL[0]:-config/train_config.yaml}"
  NUM_NODES="${POSITIONAL[1]:-1}"
  NODE_RANK="${POSITIONAL[2]:-0}"
  MASTER_HOST="${POSITIONAL[3]:-localhost}"
  PORT="${POSITIONAL[4]:-29500}"
}

validate_args() {
  [[ "${NUM_NODES}" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] ||
    die_usage "num_nodes '${NUM_NODES}' must be a positive integer, or MIN:MAX for an elastic job (e.g. 2:4)"
  NODES_MIN=$((10#${NUM_NODES%%:*})) NODES_MAX=$((10#${NUM_NODES##*:}))
  ((NODES_MIN <= NODES_MAX)) || die_usage "num_nodes '${NUM_NODES}': MIN must not exceed MAX"
  ELASTIC=$((NODES_MIN < NODES_MAX)) # 1: MIN:MAX with room to shrink or grow
  is_uint "${NODE_RANK}" || die_usage "node_rank '${NODE_RANK}' must be a non-negative integer"
  ((10#${NODE_RANK} < NODES_MAX)) ||
    die_usage "node_rank ${NODE_RANK} is out of range for num_nodes ${NUM_NODES} (expected 0..$((NODES_MAX - 1)))"
  # Positive: c10d's rendezvous refuses a last call of 0 with a traceback, after the health checks.
  [[ "${RDZV_LAST_CALL_S:=2}" =~ ^[1-9][0-9]*$ ]] ||
    die_usage "RDZV_LAST_CALL_S '${RDZV_LAST_CALL_S}' must be a positive number of seconds"
  if ! is_uint "${PORT}" || ((10#${PORT} < 1 || 10#${PORT} > 65535)); then
    die_usage "master_port '${PORT}' must be an integer in 1..65535"
  fi
  [[ "${MASTER_HOST}" =~ ^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$ || "${MASTER_HOST}" =~ ^[0-9A-Fa-f:.]+$ ]] ||
    die_usage "master_addr '${MASTER_HOST}' is not a valid hostname or IP address"
  MASTER_IP="$(getent ahosts "${MASTER_HOST}" | awk 'NR == 1 { print $1 }')" || true
  [[ -n "${MASTER_IP}" ]] || die_usage "master_addr '${MASTER_HOST}' does not resolve (check the name, /etc/hosts or DNS)"
  [[ -f "${CONFIG}" ]] || die_usage "config file ${CONFIG} does not exist"
  if ((NODE_RANK == 0)) && port_answers "${MASTER_IP}" "${PORT}"; then
    die_usage "master_port ${PORT} is already in use on ${MASTER_HOST} (another job?); choose a free port"
  fi
}

# True when something already accepts TCP connections at $1:$2 (the child shell expands them).
# shellcheck disable=SC2016
port_answers() {
  timeout 2 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$1" "$2" 2>/dev/null
}

validate_env() {
  case "${BACKEND:=auto}" in auto | nccl | gloo) ;; *) die_usage "BACKEND '${BACKEND}' must be auto, nccl or gloo" ;; esac
  case "${NCCL_PRESET:=auto}" in auto | ib | ethernet | none) ;;
    *) die_usage "NCCL_PRESET '${NCCL_PRESET}' must be auto, ib, ethernet or none" ;; esac
  LOG_LEVEL="${LOG_LEVEL:-INFO}"
  LOG_LEVEL="${LOG_LEVEL^^}"
  case "${LOG_LEVEL}" in INFO | DEBUG) ;; *) die_usage "LOG_LEVEL '${LOG_LEVEL}' must be INFO or DEBUG" ;; esac
  case "${HEALTH_CHECKS:=1}" in 0 | 1) ;; *) die_usage "HEALTH_CHECKS '${HEALTH_CHECKS}' must be 1 or 0" ;; esac
  is_uint "${MAX_RESTARTS:=3}" || die_usage "MAX_RESTARTS '${MAX_RESTARTS}' must be a non-negative integer"
  [[ "${RDZV_TIMEOUT:=900}" =~ ^[1-9][0-9]*$ ]] || die_usage "RDZV_TIMEOUT '${RDZV_TIMEOUT}' must be a positive number of seconds"
  [[ -z "${RDZV_STORE_TIMEOUT:-}" || "${RDZV_STORE_TIMEOUT}" =~ ^[1-9][0-9]*$ ]] ||
    die_usage "RDZV_STORE_TIMEOUT '${RDZV_STORE_TIMEOUT}' must be a positive number of seconds"
  [[ "${MONITOR_INTERVAL:=1}" =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)$ && ! "${MONITOR_INTERVAL}" =~ ^[0.]+$ ]] ||
    die_usage "MONITOR_INTERVAL '${MONITOR_INTERVAL}' must be a positive number of seconds"
  case "${WORKER_START:=forkserver}" in forkserver | subprocess) ;;
    *) die_usage "WORKER_START '${WORKER_START}' must be forkserver or subprocess" ;; esac
  [[ "${LOG_RANKS:=0}" =~ ^(all|[0-9]+(,[0-9]+)*)$ ]] || die_usage "LOG_RANKS '${LOG_RANKS}' must be all or a list like 0,1"
  for var in LOG_MAX_BYTES LOG_BACKUPS LOG_KEEP_RUNS; do
    [[ -z "${!var:-}" ]] || is_uint "${!var}" || die_usage "${var} '${!var}' must be a non-negative integer"
  done
  case "${RESUME:-}" in "" | auto) ;; *) die_usage "RESUME '${RESUME}' must be auto or unset" ;; esac
  [[ "${NPROC_PER_NODE:=auto}" == auto || "${NPROC_PER_NODE}" =~ ^[1-9][0-9]*$ ]] ||
    die_usage "NPROC_PER_NODE '${NPROC_PER_NODE}' must be auto or a positive integer"
  export LOG_LEVEL
}

# ------------------------------------------------------------------ python environment

# Which Python runs the job: VENV, then an explicit CONDA_ENV, then the .venv that the
# README's install command creates beside this script, then the conda env purrsight, then
# whatever python is on PATH.
activate_python() {
  if [[ -n "${VENV:-}" ]]; then
    [[ -f "${VENV}/bin/activate" ]] || die_usage "VENV=${VENV} is not a virtualenv (no ${VENV}/bin/activate)"
    activate_venv "${VENV}"
  elif [[ -n "${CONDA_ENV:-}" ]]; then # set explicitly: it must work
    command -v conda >/dev/null || die_usage "CONDA_ENV=${CONDA_ENV} is set but conda is not on PATH"
    activate_conda "${CONDA_ENV}" || die_usage "CONDA_ENV=${CONDA_ENV} cannot be activated (conda env list shows the names)"
    PYTHON_SOURCE="conda env ${CONDA_ENV}"
  elif [[ -f "${SCRIPT_DIR}/.venv/bin/activate" ]]; then
    activate_venv "${SCRIPT_DIR}/.venv"
  elif command -v conda >/dev/null && activate_conda purrsight; then
    PYTHON_SOURCE="conda env purrsight"
  else
    PYTHON_SOURCE="current environment (no .venv here, no conda env 'purrsight'; set VENV or CONDA_ENV to choose one)"
  fi
  PYTHON="$(command -v python || command -v python3)" || die_usage "no python on PATH"
}

activate_venv() {
  # shellcheck disable=SC1091 # the user's virtualenv, not ours to lint
  source "$1/bin/activate"
  PYTHON_SOURCE="virtualenv $1"
}

activate_conda() {
  local base
  base="$(conda info --base 2>/dev/null)" || return 1
  # shellcheck disable=SC1091 # conda's own activation script
  source "${base}/etc/profile.d/conda.sh" || return 1
  conda activate "$1" 2>/dev/null
}

# ------------------------------------------------------------------ the node's one Python step

EXPORTED=()         # for the banner
DRY_LINES=()        # for --dry-run: shell lines a user could paste
ENVIRONMENT_DUMP=() # LOG_LEVEL=DEBUG: the masked environment the workers get

# purrsight/launcher/node_plan.py, in one process with the config parsed once: the node probe,
# the config check and placement, the run-folder check, the environment plan and the health
# checks. It writes PLAN_FILE (bash we source: NPROC, BACKEND, the exports, the banner) and
# shows its lines live, keeping them in TRANSCRIPT for the node log that starts after it. Its
# errors are held in a file and printed when it ends, so that a Python that cannot import
# purrsight at all is named in our one line, not in Python's. Sets PLAN_RC (0, or 3: a
# health check failed); any other failure ends the launcher here.
plan_node() {
  local args=(
    --plan "${PLAN_FILE}" --transcript "${TRANSCRIPT}"
    --node-rank "${NODE_RANK}" --num-nodes "${NODES_MAX}" --master-addr "${MASTER_IP}" --master-port "${PORT}"
    --backend "${BACKEND}" --nproc-per-node "${NPROC_PER_NODE}" --nccl-preset "${NCCL_PRESET}"
    --log-level "${LOG_LEVEL}" --log-dir "${LOG_DIR}" --resume "${RESUME:-}"
    --min-free-gb "${HEALTH_MIN_FREE_GB:-1}" --master-timeout "${RDZV_TIMEOUT}"
  )
  ((HEALTH_CHECKS)) || args+=(--no-health)
  ((DRY_RUN)) && args+=(--dry-run)
  PLAN_RC=0
  "${PYTHON}" -m purrsight.launcher.node_plan "${args[@]}" "${CONFIG}" "${OVERRIDES[@]}" 2>"${PLAN_ERRORS}" || PLAN_RC=$?
  if [[ -s "${PLAN_FILE}" ]]; then
    # shellcheck disable=SC1090 # written just now by node_plan.py
    source "${PLAN_FILE}"
  fi
  case "${PLAN_RC}" in
    0 | "${EXIT_HEALTH}") cat "${PLAN_ERRORS}" >&2 ;; # warnings, if any
    "${EXIT_USAGE}") cat "${PLAN_ERRORS}" >&2; exit "${EXIT_USAGE}" ;;
    *)
      if [[ ! -s "${PLAN_FILE}" ]] && grep -q "No module named" "${PLAN_ERRORS}"; then
        die_usage "${PYTHON} (${PYTHON_SOURCE}) cannot import purrsight and torch ($(tail -n 1 "${PLAN_ERRORS}")); install: $(install_hint)"
      fi
      cat "${PLAN_ERRORS}" >&2
      exit "${PLAN_RC}"
      ;;
  esac
}

# The command that installs what the launcher needs into the Python it chose.
install_hint() {
  if [[ "${PYTHON_SOURCE}" == current* ]]; then
    printf 'cd %q && python3 -m venv .venv && .venv/bin/pip install -r requirements.txt -e .' "${SCRIPT_DIR}"
  else
    printf '%q -m pip install -r %q -e %q' "${PYTHON}" "${SCRIPT_DIR}/requirements.txt" "${SCRIPT_DIR}"
  fi
}

# ------------------------------------------------------------------ logs

start_node_log() {
  RUN_STAMP="$(date '+%Y%m%d_%H%M%S')"
  RUN_NAME="cluster_train_${RUN_STAMP}_node${NODE_RANK}"
  mkdir -p "${LOG_DIR}"
  exec > >("${PYTHON}" -m purrsight.launcher.logwriter --log-dir "${LOG_DIR}" --node-rank "${NODE_RANK}" \
    --nproc "${NPROC}" --timestamp "${RUN_STAMP}" --console-ranks "${LOG_RANKS}" --shown "${TRANSCRIPT}" \
    --max-bytes "${LOG_MAX_BYTES:-104857600}" --backups "${LOG_BACKUPS:-5}" --keep-runs "${LOG_KEEP_RUNS:-10}") 2>&1
  LOGGER_PID=$!
  if [[ "${LOG_LEVEL}" == DEBUG ]]; then set -x; fi
}

# Close our end of the log pipe and wait, so the last lines are on disk when we exit.
finish_node_log() {
  set +x
  exec >/dev/null 2>&1
  wait "${LOGGER_PID}" 2>/dev/null || true
}

build_torchrun_args() {
  local endpoint="${MASTER_IP}:${PORT}" is_host=0 rdzv_conf
  [[ "${MASTER_IP}" == *:* ]] && endpoint="[${MASTER_IP}]:${PORT}"
  ((NODE_RANK == 0)) && is_host=1
  # c10d (not static): a worker that dies on any node restarts the workers on every node.
  # is_host: node 0 hosts the rendezvous store even when MASTER_ADDR is not the address of
  # its hostname (IPoIB, a secondary interface); --local-addr: workers reach each other on
  # the address that routes to the master, not on the machine's FQDN.
  # read_timeout: how long the store's connection waits for node 0 to come; store_op_timeout (ours,
  # purrsight/internals/torch_elastic.py): how long each request then waits for an answer.
  rdzv_conf="is_host=${is_host},join_timeout=${RDZV_TIMEOUT},read_timeout=${RDZV_TIMEOUT}"
  # Elastic jobs give up on a silent store within a minute: the others go on without this node.
  # A fixed count keeps torchrun's read_timeout, which lets a network outage of minutes heal.
  if ((ELASTIC)); then : "${RDZV_STORE_TIMEOUT:=60}"; else : "${RDZV_STORE_TIMEOUT:=${RDZV_TIMEOUT}}"; fi
  rdzv_conf+=",store_op_timeout=${RDZV_STORE_TIMEOUT}"
  # Elastic (MIN:MAX): once MIN nodes are in, a new round waits RDZV_LAST_CALL_S for more (c10d's
  # 30 s by default), and a node that stopped its 1 s heartbeats is dropped after 3 (default 5 s x 3):
  # the rest train again within seconds of a loss. A fixed count keeps torchrun's defaults.
  if ((ELASTIC)); then
    rdzv_conf+=",last_call_timeout=${RDZV_LAST_CALL_S},keep_alive_interval=1,keep_alive_max_attempt=3"
  fi
  TORCHRUN_ARGS=(
    -m purrsight.launcher.torchrun # torch.distributed.run without its traceback on failure
    --nnodes "${NUM_NODES}"
    --nproc-per-node "${NPROC}"
    --rdzv-backend c10d
    --rdzv-endpoint "${endpoint}"
    --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-${PBS_JOBID:-purrsight-${PORT}}}}"
    --rdzv-conf "${rdzv_conf}"
    --max-restarts "${MAX_RESTARTS}"
    --monitor-interval "${MONITOR_INTERVAL}" # torchrun's 0.1 s puts nodes x 10 queries/s on node 0's store
    --local-addr "${LOCAL_ADDR:-${MASTER_IP}}"
    --log-dir "${LOG_DIR}/${RUN_NAME:-dry_run}"
    --tee 3
  )
  # forkserver: each worker a fork of one server that imported the trainer (purrsight/launcher/forked_workers.py)
  if [[ "${WORKER_START}" == forkserver ]]; then TORCHRUN_ARGS+=(--run-path --start-method forkserver); fi
  TORCHRUN_ARGS+=("${SCRIPT_DIR}/train_phase2.py" --config "${CONFIG}" "${OVERRIDES[@]}")
}

print_banner() {
  local elastic=""
  if ((ELASTIC)); then elastic=" (elastic: goes on while ${NODES_MIN} of up to ${NODES_MAX} nodes remain)"; fi
  log "node ${NODE_RANK}/${NUM_NODES}${elastic}: master ${MASTER_HOST} (${MASTER_IP}):${PORT}, ${NPROC} process(es) on ${ACCELERATOR^^}, backend ${BACKEND}"
  log "python ${NODE_PYTHON} (${PYTHON}, ${PYTHON_SOURCE}); torch ${NODE_TORCH}; CUDA ${NODE_CUDA}; NCCL ${NODE_NCCL}; GPUs ${NODE_GPUS} ${NODE_GPU_NAMES}"
  log "environment (a variable you exported yourself is kept):"
  local line
  for line in "${EXPORTED[@]}"; do log "  ${line}"; done
  log "torchrun: ${PYTHON} ${TORCHRUN_ARGS[*]}"
  if [[ "${LOG_LEVEL}" == DEBUG ]]; then
    log "environment (values of names with TOKEN, KEY, SECRET or PASSWORD masked):"
    printf '%s\n' "${ENVIRONMENT_DUMP[@]}"
  fi
}

# ------------------------------------------------------------------ run

TORCHRUN_PID=""
SIGNALLED=""

# shellcheck disable=SC2317 # invoked by the traps in run_torchrun
forward_signal() {
  SIGNALLED="$1"
  log "received SIG$1: passing it to torchrun (workers save a checkpoint, then exit)"
  if [[ -n "${TORCHRUN_PID}" ]]; then kill -s "$1" "${TORCHRUN_PID}" 2>/dev/null || true; fi
}

run_torchrun() {
  trap 'forward_signal TERM' TERM
  trap 'forward_signal INT' INT
  "${PYTHON}" "${TORCHRUN_ARGS[@]}" &
  TORCHRUN_PID=$!
  local rc=0
  while :; do
    wait "${TORCHRUN_PID}" && rc=0 || rc=$?
    # wait returns early when a trapped signal arrives; keep waiting while torchrun lives
    kill -0 "${TORCHRUN_PID}" 2>/dev/null || break
  done
  trap - TERM INT
  return "${rc}"
}

# The job's exit code: torchrun's (our wrapper returns the workers' documented reason: bad
# input 2, a cluster check 3, the watchdog 86), or 128+N after a signal we forwarded: the
# workers saved a checkpoint and stopped on request.
job_exit_code() {
  if (($1 != 0)) && [[ -n "${SIGNALLED}" ]]; then echo $((128 + $(kill -l "${SIGNALLED}"))); else echo "$1"; fi
}

main() {
  local launched
  launched="$(now_us)" # the node-ready line reports the time since (docs/SCALING.md)
  parse_args "$@"
  validate_args
  validate_env
  LOG_DIR="${LOG_DIR:-logs/distributed_training}"
  activate_python
  if [[ -n "${RESUME:-}" ]]; then export PURRSIGHT_RESUME="${RESUME}"; fi
  export PURRSIGHT_NODE_RANK="${NODE_RANK}" # the trainer orders global ranks by node (purrsight.distributed.process_group)
  # Elastic: the nodes of a round may have gaps (node 1 of 0-2 lost), so the ranks are ordered
  # through the store, among the nodes present, not by node_rank x processes.
  if ((ELASTIC)); then export PURRSIGHT_ELASTIC_NODES="${NUM_NODES}"; fi
  # The attempt's launch time: its start-up is counted from here (purrsight/runs/attempts.py),
  # or from a batch script's start when it set one (slurm/train.sbatch).
  PURRSIGHT_LAUNCH_TIME="${PURRSIGHT_LAUNCH_TIME:-$((launched / 1000000)).$(printf '%06d' $((launched % 1000000)))}"
  export PURRSIGHT_LAUNCH_TIME
  # Workers count their restarts on this node under this id (purrsight.distributed.process_group.worker_generation).
  PURRSIGHT_LAUNCH_ID="${RDZV_ID:-node${NODE_RANK}}-$$-$(date +%s)"
  export PURRSIGHT_LAUNCH_ID
  local scratch="${TMPDIR:-/tmp}/purrsight-${PURRSIGHT_LAUNCH_ID}"
  PLAN_FILE="${scratch}.plan" TRANSCRIPT="${scratch}.shown" PLAN_ERRORS="${scratch}.errors"
  # shellcheck disable=SC2064 # the names are fixed now
  trap "rm -f '${PLAN_FILE}' '${TRANSCRIPT}' '${PLAN_ERRORS}' '${scratch}'-*.starts" EXIT
  plan_node
  if ((DRY_RUN)); then
    build_torchrun_args
    printf '%s\n' "${DRY_LINES[@]}" "export PURRSIGHT_NODE_RANK=${NODE_RANK}  # global ranks ordered by node"
    if ((ELASTIC)); then
      printf '%s\n' "export PURRSIGHT_ELASTIC_NODES=${NUM_NODES}  # ranks ordered among the nodes each round has"
    fi
    if [[ "${LOG_LEVEL}" == DEBUG ]]; then printf '# %s\n' "${ENVIRONMENT_DUMP[@]}"; fi
    printf 'exec'
    printf ' %q' "${PYTHON}" "${TORCHRUN_ARGS[@]}"
    printf '\n'
    exit 0
  fi
  start_node_log
  build_torchrun_args
  print_banner
  if ((PLAN_RC == EXIT_HEALTH)); then
    log "health checks failed: not starting training on this node"
    finish_node_log
    exit "${EXIT_HEALTH}"
  fi
  log "node ready after $(seconds_since "${launched}") s (probe, config check, health checks); starting torchrun"
  local rc=0
  run_torchrun || rc=$?
  rc="$(job_exit_code "${rc}")"
  if ((rc == 0)); then
    log "training finished; node log ${LOG_DIR}/${RUN_NAME}.log"
  else
    log "training ended with exit code ${rc}${SIGNALLED:+ after SIG${SIGNALLED}}; node log ${LOG_DIR}/${RUN_NAME}.log"
  fi
  finish_node_log
  exit "${rc}"
}

main "$@"
