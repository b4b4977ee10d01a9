"""`train_phase2.py estimate` for exactly what bench/gpu/gpu_throughput.py trains on one GPU.

gpu_throughput builds config/qwen2.5-0.5b.yaml's model from config dicts (bench/common.py),
batch 8, bf16-mixed, and reports ``torch.cuda.max_memory_allocated`` over its timed steps (the
weights, AdamW's state, the step's activations, logits and gradients; not the CUDA context or the
allocator's cache). This prints the estimate's ddp figure for one GPU at the same settings, one
line per sequence length, to set beside that table (bench/results/model.md). It reads no device.

    .venv/bin/python -m bench.model.estimate_vs_gpu 512 1024      # here
    .venv/bin/python -m bench.gpu.gpu_throughput --steps 5 --warmup 2   # on the GPU
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import REAL_CONFIG, REPO, random_init_overrides, synthetic_tokenizer

GIB = 2**30


def main() -> int:
    lengths = [int(arg) for arg in sys.argv[1:]] or [512, 1024]
    with tempfile.TemporaryDirectory(prefix="bench-estimate-") as tmp:
        overrides = random_init_overrides(synthetic_tokenizer(Path(tmp) / "synthetic"))
        print("| seq len | estimate, ddp, one GPU (GiB) | of which logits | activations |")
        print("|---|---|---|---|")
        for length in lengths:
            command = [sys.executable, str(REPO / "train_phase2.py"), "estimate", "--config", str(REAL_CONFIG), "--json"]
            command += [*overrides, f"data.max_length={length}", "data.batch_size=8", "trainer.precision=bf16-mixed"]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            ddp = json.loads(done.stdout)["per_gpu_bytes"]["ddp"]
            print(f"| {length} | {ddp['total'] / GIB:.2f} | {ddp['logits'] / GIB:.2f} | {ddp['activations'] / GIB:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
