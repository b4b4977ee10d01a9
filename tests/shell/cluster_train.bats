#!/usr/bin/env bats
# Argument and environment validation of cluster_train.sh, and its --dry-run output.
# Every failure must be one error line (plus the --help hint) and exit 2, before anything starts.

setup() {
  REPO="$(cd "${BATS_TEST_DIRNAME}/../.." && pwd)"
  cd "${REPO}" || exit 1
  export PATH="${REPO}/.venv/bin:${PATH}"
  export LOG_DIR="${BATS_TEST_TMPDIR}/logs"
  unset CONDA_ENV VENV BACKEND NPROC_PER_NODE NCCL_PRESET LOG_LEVEL OMP_NUM_THREADS
}

# exit 2 with one error line naming $1, and no log folder created
assert_usage_error() {
  [ "${status}" -eq 2 ]
  [ "$(grep -c 'error:' <<<"${output}")" -eq 1 ]
  grep -q -- "$1" <<<"${output}"
  grep -q "Try './cluster_train.sh --help'" <<<"${output}"
  [[ "${output}" != *Traceback* ]]
  [ ! -e "${LOG_DIR}" ]
}

@test "--help answers the usual questions" {
  run ./cluster_train.sh --help
  [ "${status}" -eq 0 ]
  for needle in "Usage:" NPROC_PER_NODE BACKEND LOG_LEVEL CONDA_ENV VENV LOG_DIR MAX_RESTARTS RDZV_TIMEOUT \
    HEALTH_CHECKS NCCL_PRESET LOG_RANKS "2 1 10.0.0.1 29500" sbatch qsub "Exit codes"; do
    grep -q -- "${needle}" <<<"${output}"
  done
}

@test "num_nodes must be a positive integer" {
  run ./cluster_train.sh config/train_config.yaml two
  assert_usage_error "num_nodes 'two' must be a positive integer"
  run ./cluster_train.sh config/train_config.yaml 0
  assert_usage_error "num_nodes '0' must be a positive integer"
}

@test "node_rank must be in range" {
  run ./cluster_train.sh config/train_config.yaml 2 2
  assert_usage_error "node_rank 2 is out of range for num_nodes 2 (expected 0..1)"
  run ./cluster_train.sh config/train_config.yaml 2 -1
  assert_usage_error "node_rank '-1' must be a non-negative integer"
  run ./cluster_train.sh config/train_config.yaml -2
  assert_usage_error "num_nodes '-2' must be a positive integer"
  run ./cluster_train.sh config/train_config.yaml 2 x
  assert_usage_error "node_rank 'x' must be a non-negative integer"
}

@test "num_nodes MIN:MAX: an elastic job; MIN above MAX, or a node_rank past MAX, is refused" {
  run ./cluster_train.sh config/train_config.yaml 3:2
  assert_usage_error "num_nodes '3:2': MIN must not exceed MAX"
  run ./cluster_train.sh config/train_config.yaml 2:3 3
  assert_usage_error "node_rank 3 is out of range for num_nodes 2:3 (expected 0..2)"
  run ./cluster_train.sh config/train_config.yaml 2:
  assert_usage_error "num_nodes '2:' must be a positive integer, or MIN:MAX for an elastic job"
  RDZV_LAST_CALL_S=soon run ./cluster_train.sh config/train_config.yaml 2:3 1
  assert_usage_error "RDZV_LAST_CALL_S 'soon' must be a positive number of seconds"
  RDZV_LAST_CALL_S=0 run ./cluster_train.sh config/train_config.yaml 2:3 1
  assert_usage_error "RDZV_LAST_CALL_S '0' must be a positive number of seconds"
  RDZV_STORE_TIMEOUT=0 run ./cluster_train.sh config/train_config.yaml 2:3 1
  assert_usage_error "RDZV_STORE_TIMEOUT '0' must be a positive number of seconds"
  # --dry-run: torchrun gets MIN:MAX and the fast rendezvous; a fixed count keeps torchrun's timings
  BACKEND=gloo run ./cluster_train.sh --dry-run config/train_config.yaml 2:3 2 127.0.0.1 29511
  [ "${status}" -eq 0 ]
  grep -q -- "--nnodes 2:3 " <<<"${output}"
  grep -q "export PURRSIGHT_ELASTIC_NODES=2:3" <<<"${output}"
  grep -q 'last_call_timeout=2\\\?,keep_alive_interval=1\\\?,keep_alive_max_attempt=3' <<<"${output}"
  grep -q 'store_op_timeout=60' <<<"${output}" # elastic: a silent store is given up within a minute
  BACKEND=gloo run ./cluster_train.sh --dry-run config/train_config.yaml 2 1 127.0.0.1 29511
  [ "${status}" -eq 0 ]
  grep -q -- "--nnodes 2 " <<<"${output}"
  [[ "${output}" != *last_call_timeout* && "${output}" != *PURRSIGHT_ELASTIC_NODES* ]]
  # a fixed count: a request to the store may wait as long as the connection, RDZV_TIMEOUT
  grep -q 'read_timeout=900\\\?,store_op_timeout=900' <<<"${output}"
}

@test "more than five positional arguments are refused (overrides go after --)" {
  run ./cluster_train.sh config/train_config.yaml 1 0 localhost 29500 extra
  assert_usage_error "too many arguments (6); overrides go after --"
}

@test "master_port must be 1..65535" {
  run ./cluster_train.sh config/train_config.yaml 1 0 localhost 70000
  assert_usage_error "master_port '70000' must be an integer in 1..65535"
  run ./cluster_train.sh config/train_config.yaml 1 0 localhost port
  assert_usage_error "master_port 'port' must be an integer in 1..65535"
}

@test "master_addr must be valid and resolve" {
  run ./cluster_train.sh config/train_config.yaml 2 1 'bad host!'
  assert_usage_error "is not a valid hostname or IP address"
  run ./cluster_train.sh config/train_config.yaml 2 1 no-such-host.invalid
  assert_usage_error "master_addr 'no-such-host.invalid' does not resolve"
}

@test "config file must exist and be valid" {
  run ./cluster_train.sh config/nope.yaml
  assert_usage_error "config file config/nope.yaml does not exist"
  run ./cluster_train.sh config/train_config.yaml -- trainer.max_stepz=3
  [ "${status}" -eq 2 ]
  grep -q "did you mean trainer.max_steps" <<<"${output}"
  grep -q "config config/train_config.yaml is invalid" <<<"${output}"
}

@test "environment variables are checked against their lists" {
  BACKEND=mpi run ./cluster_train.sh
  assert_usage_error "BACKEND 'mpi' must be auto, nccl or gloo"
  NCCL_PRESET=roce run ./cluster_train.sh
  assert_usage_error "NCCL_PRESET 'roce' must be auto, ib, ethernet or none"
  NPROC_PER_NODE=0 run ./cluster_train.sh
  assert_usage_error "NPROC_PER_NODE '0' must be auto or a positive integer"
  LOG_LEVEL=LOUD run ./cluster_train.sh
  assert_usage_error "LOG_LEVEL 'LOUD' must be INFO or DEBUG"
  for interval in 0 0.0 -1 1e3 fast; do
    MONITOR_INTERVAL="${interval}" run ./cluster_train.sh
    assert_usage_error "MONITOR_INTERVAL '${interval}' must be a positive number of seconds"
  done
}

@test "more processes than GPUs with nccl is refused" {
  # as many GPUs as the probe sees here (0 on CPU machines), plus one
  gpus="$(python -c 'from purrsight.launcher.probe import probe; print(probe().gpus)')"
  BACKEND=nccl NPROC_PER_NODE=$((gpus + 1)) run ./cluster_train.sh
  [ "${status}" -eq 2 ]
  if ((gpus == 0)); then
    grep -q "backend nccl needs GPUs but no GPU is visible here; use BACKEND=gloo" <<<"${output}"
  else
    grep -q "NPROC_PER_NODE=$((gpus + 1)) but only ${gpus} GPU(s) are visible" <<<"${output}"
  fi
}

@test "the placement the launcher decides is the one its workers get" {
  BACKEND=gloo run ./cluster_train.sh --dry-run
  [ "${status}" -eq 0 ]
  grep -q '^export PURRSIGHT_ACCELERATOR=cpu PURRSIGHT_BACKEND=gloo' <<<"${output}"
  # the config's own choice counts when BACKEND is left to auto
  run ./cluster_train.sh --dry-run config/train_config.yaml -- distributed.backend=gloo trainer.accelerator=cpu
  grep -q '^export PURRSIGHT_ACCELERATOR=cpu PURRSIGHT_BACKEND=gloo' <<<"${output}"
}

@test "threads per process come from the CPUs the launcher may use" {
  NPROC_PER_NODE=1 run taskset -c 0 ./cluster_train.sh --dry-run
  [ "${status}" -eq 0 ]
  grep -q "^export OMP_NUM_THREADS=1  # 1 CPUs (affinity mask) / 1 processes" <<<"${output}"
  NPROC_PER_NODE=1 SLURM_CPUS_PER_TASK=1 run ./cluster_train.sh --dry-run
  grep -q "^export OMP_NUM_THREADS=1  # 1 CPUs (SLURM_CPUS_PER_TASK) / 1 processes" <<<"${output}"
}

# The python that --dry-run would exec (its first word after "exec").
dry_run_python() {
  run "$@" --dry-run
  [ "${status}" -eq 0 ]
  grep '^exec ' <<<"${output}" | awk '{ print $2 }'
}

# A stand-in for conda (it cannot be installed from Debian's or PyPI's packages here): it
# answers `conda info --base` and its conda.sh activates only the env "purrsight", a
# virtualenv of the system python, by putting it first on PATH as conda does.
make_conda() {
  local base="${BATS_TEST_TMPDIR}/conda"
  mkdir -p "${base}/bin" "${base}/etc/profile.d"
  python3 -m venv --without-pip "${base}/envs/purrsight"
  printf '#!/bin/sh\n[ "$1 $2" = "info --base" ] && echo %s\n' "${base}" >"${base}/bin/conda"
  chmod +x "${base}/bin/conda"
  printf 'conda() { [ "$1" = activate ] && [ -d "%s/envs/$2" ] && PATH="%s/envs/$2/bin:${PATH}"; }\n' \
    "${base}" "${base}" >"${base}/etc/profile.d/conda.sh"
  echo "${base}"
}

@test "without conda on PATH an explicit CONDA_ENV is refused by name" {
  PATH=/usr/bin:/bin CONDA_ENV=missing-env run ./cluster_train.sh
  assert_usage_error "CONDA_ENV=missing-env is set but conda is not on PATH"
  VENV=/nonexistent run ./cluster_train.sh
  assert_usage_error "VENV=/nonexistent is not a virtualenv"
}

@test "with conda an explicit CONDA_ENV must be activatable" {
  base="$(make_conda)"
  PATH="${base}/bin:/usr/bin:/bin" CONDA_ENV=missing-env run ./cluster_train.sh
  assert_usage_error "CONDA_ENV=missing-env cannot be activated"
}

@test "the python is chosen: VENV, then CONDA_ENV, then the README's .venv, then conda's purrsight" {
  [ -x "${REPO}/.venv/bin/python" ] || skip "no .venv beside the launcher (scripts/test.sh creates it)"
  base="$(make_conda)"
  # Nothing set, .venv present: the README's install is used even with conda and another python on PATH.
  [ "$(PATH="${base}/bin:/usr/bin:/bin" dry_run_python ./cluster_train.sh)" = "${REPO}/.venv/bin/python" ]
  # An explicit CONDA_ENV wins over .venv (and fails here: its env has no torch, which names the env).
  PATH="${base}/bin:/usr/bin:/bin" CONDA_ENV=purrsight run ./cluster_train.sh --dry-run
  assert_usage_error "conda/envs/purrsight/bin/python (conda env purrsight) cannot import purrsight and torch"
  # A copy of the launcher without a .venv beside it falls back to conda's purrsight env.
  cp cluster_train.sh train_phase2.py "${BATS_TEST_TMPDIR}/"
  cp -r config "${BATS_TEST_TMPDIR}/"
  cd "${BATS_TEST_TMPDIR}"
  PATH="${base}/bin:/usr/bin:/bin" run ./cluster_train.sh --dry-run
  grep -q "conda/envs/purrsight/bin/python (conda env purrsight) cannot import" <<<"${output}"
}

@test "a Python without torch and purrsight is refused with a command that installs them" {
  # a virtualenv of the system Python: no torch, no purrsight (run from elsewhere, so the
  # repository is not importable from the working folder either)
  python3 -m venv --without-pip "${BATS_TEST_TMPDIR}/bare"
  cd "${BATS_TEST_TMPDIR}"
  VENV="${BATS_TEST_TMPDIR}/bare" run "${REPO}/cluster_train.sh" "${REPO}/config/train_config.yaml"
  [ "${status}" -eq 2 ]
  grep -qF "bare/bin/python (virtualenv ${BATS_TEST_TMPDIR}/bare) cannot import purrsight and torch (" <<<"${output}"
  grep -qF "No module named 'purrsight'" <<<"${output}"  # the import error itself
  grep -qF "; install: ${BATS_TEST_TMPDIR}/bare/bin/python -m pip install -r ${REPO}/requirements.txt -e ${REPO}" <<<"${output}"
}

@test "--dry-run prints the environment and the torchrun command, starts nothing" {
  OMP_NUM_THREADS=5 NPROC_PER_NODE=2 run ./cluster_train.sh --dry-run config/train_config.yaml 2 1 127.0.0.1 29555 -- trainer.max_steps=7 'run.name=a b'
  [ "${status}" -eq 0 ]
  grep -q '^export MASTER_ADDR=127.0.0.1' <<<"${output}"
  grep -q '^export MASTER_PORT=29555' <<<"${output}"
  grep -q '^# kept OMP_NUM_THREADS=5' <<<"${output}"  # the user's value survives
  grep -q '^export PURRSIGHT_NODE_RANK=1' <<<"${output}"
  cmd="$(grep '^exec ' <<<"${output}")"
  for needle in "--nnodes 2" "--nproc-per-node 2" "--rdzv-backend c10d" "--rdzv-endpoint 127.0.0.1:29555" \
    "is_host=0" "--max-restarts 3" "--monitor-interval 1" "trainer.max_steps=7" 'run.name=a\ b'; do
    grep -qF -- "${needle}" <<<"${cmd}"
  done
  [ ! -e "${LOG_DIR}" ]
  [ ! -e runs/phase2-tiny/checkpoints/step-00000007.ckpt ]
}

@test "MONITOR_INTERVAL reaches torchrun, fractions too" {
  MONITOR_INTERVAL=0.5 run ./cluster_train.sh --dry-run config/train_config.yaml
  [ "${status}" -eq 0 ]
  grep -qF -- "--monitor-interval 0.5 " <<<"$(grep '^exec ' <<<"${output}")"
}

@test "node 0 hosts the rendezvous" {
  run ./cluster_train.sh --dry-run config/train_config.yaml 2 0 127.0.0.1 29556
  [ "${status}" -eq 0 ]
  grep -q "is_host=1" <<<"${output}"
}
