#!/usr/bin/env bash
# Install what the tests need on a fresh machine, then lint and run the whole suite.
#
#   bash scripts/test.sh                 # everything (what CI runs)
#   bash scripts/test.sh tests/unit -x   # extra arguments go to pytest
#
# The CPU build of torch is installed first and pinned: requirements.txt holds a range
# (right for GPU users), and with 2.13.0 already present pip fetches nothing larger.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
readonly VENV_DIR="${VENV_DIR:-.venv}"

log() { printf '[test.sh %(%H:%M:%S)T] %s\n' -1 "$*"; }

log "python environment in ${VENV_DIR}"
python3 -m venv "${VENV_DIR}"
"${VENV_DIR}/bin/python" -m pip install -q --upgrade pip
"${VENV_DIR}/bin/python" -m pip install -q torch==2.13.0
"${VENV_DIR}/bin/python" -m pip install -q -r requirements-dev.txt -e .

log "lint"
"${VENV_DIR}/bin/ruff" check .

log "tests"
exec "${VENV_DIR}/bin/python" -m pytest "$@"
