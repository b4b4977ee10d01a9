#!/usr/bin/env bash
# The GPU work of a session lent a GPU machine, as one script (bench/gpu/README.md): profile the
# 0.5B preset's step (and time it with the LoRA adapters' compute copies against autocast's
# per-use casts, side by side), measure throughput, MFU and peak memory against the estimate (0.5B eager and
# compiled at 1,024 and 4,096 tokens, the auto micro-batch, 7B eager at 1,024), run tests/gpu, then
# what no GPU has run yet: the compiled layers as CUDA graphs and the loss's scorer eager against compiled. Each part has its
# own time limit and all of them one deadline, so a part that hangs leaves time for the rest.
# Results go to ${OUT} (the device tool's folder, which brings back at most 8 files): one file a
# part, summary.txt, and gpu-rows.json (8 files; nothing more comes back), the issue-48 table
# ({"device", "torch", "rows": [{"preset", "compile", "seq_len", "batch", "mfu", "step_s",
# "peak_bytes", "estimate_bytes", ...}]}); commit it as bench/results/gpu-<date>.json.
#
#   bash bench/gpu_session.sh            # on the GPU machine, from the repository root
#
# Budget: 550 s of parts from the start (the device tool's limit is 600 s a call): timeout_s=600.
set -uo pipefail

OUT="${OUT:-/tmp/gpu-session}"
BUDGET_S="${GPU_SESSION_BUDGET_S:-550}"
mkdir -p "${OUT}"
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
readonly deadline=$((SECONDS + BUDGET_S))

log() { printf '%s %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "${OUT}/summary.txt"; }

# part NAME SECONDS COMMAND...: runs COMMAND with its output added to ${OUT}/NAME.txt (NAME+MORE:
# to NAME.txt too: at most 8 files come back), for at most
# SECONDS or until the session's deadline, whichever comes first.
part() {
  local name="$1" seconds="$2" status=0 left=$((deadline - SECONDS))
  shift 2
  ((left < seconds)) && seconds="${left}"
  if ((seconds < 20)); then
    log "skip ${name}: ${left} s left"
    return
  fi
  log "start ${name} (${seconds} s): $*"
  timeout --signal=INT --kill-after=10 "${seconds}" "$@" >>"${OUT}/${name%%+*}.txt" 2>&1 || status=$?
  log "end ${name}: exit ${status}"
  tail -n 25 "${OUT}/${name%%+*}.txt" >>"${OUT}/summary.txt"
}

# The GPU machine's image holds PyTorch (CUDA), transformers, peft and Lightning in its python3
# (/work/.library/device/KINDS.md); the project runs from this tree, not installed.
PY="${PYTHON:-python3}"
export PYTHONPATH="${PWD}${PYTHONPATH:+:${PYTHONPATH}}" PYTHONUNBUFFERED=1
log "$(${PY} -c 'import torch, transformers, pydantic; print("torch", torch.__version__, "transformers", transformers.__version__, "pydantic", pydantic.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")' 2>&1)"
log "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"

rows="${OUT}/gpu-rows.json"
part profile-0.5b-1024 80 "${PY}" -m bench.gpu.step_profile profile --preset 0.5b --seq-len 1024  # its text holds the tables; no --json: 8 files come back at most
part throughput-0.5b 80 "${PY}" -m bench.gpu.gpu_throughput --seq-lens 1024 4096 --steps 8 --warmup 3 --json "${rows}"
# The preset as it ships: micro-batch and checkpointing chosen for this GPU (issue 48 item 4).
part throughput-0.5b+auto 90 "${PY}" -m bench.gpu.gpu_throughput --seq-lens 1024 --steps 5 --warmup 2 --json "${rows}" data.batch_size=auto model.llm.gradient_checkpointing=auto
# One length a process: recompiling for a second length crashed in inductor on torch 2.11 (bench/results/gpu.md).
part throughput-0.5b-compile-1024 75 "${PY}" -m bench.gpu.gpu_throughput --compile --seq-lens 1024 --steps 8 --warmup 3 --json "${rows}"
part throughput-0.5b-compile-4096 75 "${PY}" -m bench.gpu.gpu_throughput --compile --seq-lens 4096 --steps 8 --warmup 3 --json "${rows}"
part throughput-7b 100 "${PY}" -m bench.gpu.gpu_throughput --preset 7b --seq-lens 1024 --steps 5 --warmup 2 --json "${rows}"
part tests-gpu 130 "${PY}" -m pytest -x -q -p no:cacheprovider tests/gpu
# Last, what no GPU has run yet (2026-11-29): what the deadline leaves them.
# CUDA graphs on the padded static shapes (trainer.cuda_graphs): its text goes to the compiled 1,024 file.
part throughput-0.5b-compile-1024+graphs 75 "${PY}" -m bench.gpu.gpu_throughput --compile --seq-lens 1024 --steps 8 --warmup 3 --json "${rows}" trainer.compile=true data.pad_to_multiple_of=128 trainer.cuda_graphs=true
# The loss's chunk scorer, eager against compiled, at the 0.5B head and 8 x 1,024 positions (its text goes to the profile's file).
part profile-0.5b-1024+loss 40 "${PY}" -m bench.gpu.loss_scorer --device cuda --rows 8192
log "done"
