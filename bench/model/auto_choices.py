"""What ``data.batch_size: auto`` and ``model.llm.gradient_checkpointing: auto`` choose for the presets as
they ship (their ``trainer.global_batch_size``), by GPU memory and count: the choice training makes at
start (purrsight/estimate/auto_fit.py), made here on the meta device from the presets' config dicts,
with no GPU; the seconds it took are what a start spends on it. docs/SCALING.md holds the table.

    .venv/bin/python -m bench.model.auto_choices                          # both presets, 80 and 141 GB, 1 and 8 GPUs
    .venv/bin/python -m bench.model.auto_choices --presets 0.5b --gpus 2 --gpu-memory 24
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.common import MEASURED_SETTINGS, random_init_overrides, synthetic_tokenizer
from bench.gpu.gpu_throughput import PRESETS
from purrsight.config import load_config
from purrsight.errors import UserError
from purrsight.estimate.auto_fit import auto_choice
from purrsight.estimate.memory import FSDP_ONE_PROCESS
from purrsight.global_batch import accumulation_for


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=sorted(PRESETS))
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 8], help="GPUs the job trains on")
    parser.add_argument("--gpu-memory", type=float, nargs="+", default=[80, 141], help="one GPU's memory, GB")
    args = parser.parse_args()
    if min(args.gpus) < 1 or min(args.gpu_memory) <= 0:
        parser.error("--gpus and --gpu-memory take positive numbers")
    head = "| preset | global batch | GPUs | GPU memory (GB) | micro-batch | checkpointing | micro-batches a step"
    print(f"{head} | estimate (GB) | chosen in (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench-auto-") as tmp:
        tokenizer = synthetic_tokenizer(Path(tmp) / "synthetic")
        for preset in args.presets:
            path, llm = PRESETS[preset]
            shape = [o for o in random_init_overrides(tokenizer, llm) if o not in MEASURED_SETTINGS]  # the preset's auto
            config = load_config(path, shape, check_paths=False)
            asked = config.trainer.global_batch_size
            assert asked is not None  # the presets state it
            for gpus in args.gpus:
                for memory in args.gpu_memory:
                    if config.distributed.strategy == "fsdp" and gpus == 1:
                        print(f"| {preset} | {asked} | {gpus} | {memory:g} | refused: {FSDP_ONE_PROCESS} | | | | |")
                        continue
                    started = time.perf_counter()
                    try:
                        choice = auto_choice(config, gpus, int(memory * 1e9), f"{memory:g} GB", "bf16-mixed")
                    except UserError as err:
                        print(f"| {preset} | {asked} | {gpus} | {memory:g} | refused: {err} | | | | |")
                        continue
                    took = time.perf_counter() - started
                    steps = accumulation_for(asked, gpus, choice.batch_size)
                    on = "on" if choice.gradient_checkpointing else "off"
                    print(
                        f"| {preset} | {asked} | {gpus} | {memory:g} | {choice.batch_size} | {on} | {steps} "
                        f"| {choice.per_device / 1e9:.1f} | {took:.1f} |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
