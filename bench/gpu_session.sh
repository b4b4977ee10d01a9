#!/usr/bin/env bash
# The GPU work of a session lent a GPU machine, as one script (bench/gpu/README.md): profile the
# presets' step, then measure throughput and memory, each part timed out on its own so that one
# that hangs leaves time for the rest. Results go to ${OUT} (the device tool's folder), one file
# a part plus summary.txt; copy them into bench/results/gpu.md with the date and commit.
#
#   bash bench/gpu_session.sh            # on the GPU machine, from the repository root
#
# Budget: at most 540 s of parts (the device tool's limit is 600 s a call): run it with timeout_s=600.
set -uo pipefail

OUT="${OUT:-/tmp/gpu-session}"
mkdir -p "${OUT}"
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

log() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "${OUT}/summary.txt"; }

# part NAME SECONDS COMMAND...: runs COMMAND with its output in ${OUT}/NAME.txt, at most SECONDS.
part() {
  local name="$1" seconds="$2" status=0
  shift 2
  log "start ${name}: $*"
  timeout --signal=INT --kill-after=10 "${seconds}" "$@" >"${OUT}/${name}.txt" 2>&1 || status=$?
  log "end ${name}: exit ${status}"
  tail -n 30 "${OUT}/${name}.txt" >>"${OUT}/summary.txt"
}

# The GPU machine's image holds PyTorch (CUDA), transformers, peft and Lightning in its python3
# (/work/.library/device/KINDS.md); the project runs from this tree, not installed.
PY="${PYTHON:-python3}"
export PYTHONPATH="${PWD}${PYTHONPATH:+:${PYTHONPATH}}" PYTHONUNBUFFERED=1
log "$(${PY} -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")')"
log "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"

part profile-0.5b-1024 100 "${PY}" -m bench.gpu.step_profile profile --preset 0.5b --seq-len 1024 --json "${OUT}/profile-0.5b-1024.json"
part profile-7b-1024 150 "${PY}" -m bench.gpu.step_profile profile --preset 7b --seq-len 1024 --json "${OUT}/profile-7b-1024.json"
part throughput-0.5b 100 "${PY}" -m bench.gpu.gpu_throughput --steps 10 --warmup 3
part throughput-0.5b-compile 130 "${PY}" -m bench.gpu.gpu_throughput --compile --steps 10 --warmup 3
part estimate-vs-gpu 60 "${PY}" -m bench.model.estimate_vs_gpu 512 1024
log "done"
