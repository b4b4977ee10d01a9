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
  assert_usage_error "unknown option -1"
  run ./cluster_train.sh config/train_config.yaml 2 x
  assert_usage_error "node_rank 'x' must be a non-negative integer"
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
}

@test "more processes than GPUs with nccl is refused" {
  BACKEND=nccl NPROC_PER_NODE=2 run ./cluster_train.sh
  assert_usage_error "NPROC_PER_NODE=2 but only 0 GPU(s) are visible with BACKEND=nccl"
}

@test "an explicit CONDA_ENV must be activatable" {
  CONDA_ENV=missing-env run ./cluster_train.sh
  [ "${status}" -eq 2 ]
  grep -q "CONDA_ENV=missing-env" <<<"${output}"
  VENV=/nonexistent run ./cluster_train.sh
  assert_usage_error "VENV=/nonexistent is not a virtualenv"
}

@test "a Python without torch and purrsight is refused" {
  # a virtualenv of the system Python: no torch, no purrsight
  python3 -m venv --without-pip "${BATS_TEST_TMPDIR}/bare"
  VENV="${BATS_TEST_TMPDIR}/bare" run ./cluster_train.sh
  assert_usage_error "bare/bin/python cannot import purrsight and torch (install: pip install -r requirements.txt -e .)"
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
    "is_host=0" "--max-restarts 3" "trainer.max_steps=7" 'run.name=a\ b'; do
    grep -qF -- "${needle}" <<<"${cmd}"
  done
  [ ! -e "${LOG_DIR}" ]
  [ ! -e runs/phase2-tiny/checkpoints/step-00000007.ckpt ]
}

@test "node 0 hosts the rendezvous" {
  run ./cluster_train.sh --dry-run config/train_config.yaml 2 0 127.0.0.1 29556
  [ "${status}" -eq 0 ]
  grep -q "is_host=1" <<<"${output}"
}
