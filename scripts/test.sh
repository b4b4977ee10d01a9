#!/usr/bin/env bash
# Install what the tests need on a fresh machine, then lint and run every suite.
#
#   bash scripts/test.sh                 # everything (what CI runs)
#   bash scripts/test.sh tests/unit -x   # extra arguments go to pytest (shell lint and bats still run)
#
# System tools (shellcheck, bats, iproute2, slurm-wlm + munge for the real SLURM cluster
# that tests/cluster starts, and alsa-utils + sound-theme-freedesktop for the real speech and
# sound recordings that tests/unit/test_real_media.py decodes) come from Debian's packages
# when missing and we are root. The CPU build of torch is installed first and pinned: requirements.txt holds a
# range (right for GPU users), and with 2.13.0 already present pip fetches nothing larger.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
readonly VENV_DIR="${VENV_DIR:-.venv}"
readonly SYSTEM_PACKAGES=(shellcheck bats iproute2 slurm-wlm munge alsa-utils sound-theme-freedesktop)

log() { printf '[test.sh %(%H:%M:%S)T] %s\n' -1 "$*"; }
die() { printf '[test.sh] error: %s\n' "$*" >&2; exit 1; }

install_system_packages() {
  local missing=() package
  for package in "${SYSTEM_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "${package}" 2>/dev/null | grep -q "install ok installed" || missing+=("${package}")
  done
  ((${#missing[@]})) || return 0
  ((EUID == 0)) || die "missing system packages: ${missing[*]} (apt-get install them, or run as root)"
  log "installing ${missing[*]}"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
}

install_system_packages

log "python environment in ${VENV_DIR}"
python3 -m venv "${VENV_DIR}"
"${VENV_DIR}/bin/python" -m pip install -q --upgrade pip
"${VENV_DIR}/bin/python" -m pip install -q torch==2.13.0
"${VENV_DIR}/bin/python" -m pip install -q -r requirements-dev.txt -e .
export PATH="${PWD}/${VENV_DIR}/bin:${PATH}"

log "lint: ruff, mypy, shellcheck"
ruff check .
mypy purrsight train_phase2.py bench
mapfile -t shell_files < <(git ls-files '*.sh' '*.sbatch' '*.pbs' '.ci/run')
shellcheck "${shell_files[@]}"

log "shell tests: bats"
bats tests/shell

log "python tests: pytest"
exec python -m pytest "$@"
