"""Frozen weights in bf16 under bf16 precision: memory of the real-size model, and the loss.

    python -m bench.model.frozen_bf16 memory            # the real-size model built in float32 and in bf16
    python -m bench.model.frozen_bf16 loss [--steps 20] # 20 steps of the real-size architecture, 32-true vs bf16-mixed

The real-size architecture (Qwen2.5-0.5B + SigLIP-base + wav2vec2-base, bench/common.py)
with random weights; compute and memory do not depend on the weights' values. Each build or run
is its own process, so resident memory starts from the same interpreter.

memory: parameter bytes (frozen and trainable) and the process's resident memory after the
build, over the resident memory before it. The build makes the float32 weights first (a model
folder's own dtype; the weights' fingerprint is taken from them), so the peak is the same;
what stays resident, and what Lightning moves to each GPU, is what differs.

loss: train_phase2.py itself, on CPU, with the same seed and data: precision 32-true (all
float32) against bf16-mixed (frozen weights held in bf16, LoRA and projectors in float32).
Short sequences (data.max_length=48, 1 s of audio, batch 2) keep a step within seconds here.
"""

from __future__ import annotations

import argparse
import csv
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from bench.common import REAL_CONFIG, REPO, random_init_overrides, synthetic_tokenizer


def build_once(dtype_name: str, tokenizer: Path) -> dict[str, float]:
    """In this process: build the real-size model with frozen weights in ``dtype_name``."""
    import torch

    from purrsight.config import load_config
    from purrsight.training.model_builder import build_model

    config = load_config(REAL_CONFIG, random_init_overrides(tokenizer), check_paths=False)
    process = psutil.Process()
    before = process.memory_info().rss
    model = build_model(config, getattr(torch, dtype_name)).model
    params = list(model.parameters())
    return {
        "frozen_gib": sum(p.numel() * p.element_size() for p in params if not p.requires_grad) / 2**30,
        "trainable_gib": sum(p.numel() * p.element_size() for p in params if p.requires_grad) / 2**30,
        # AdamW: two float32 moments per trainable value, whatever the frozen dtype
        "optimizer_state_gib": sum(2 * p.numel() * 4 for p in params if p.requires_grad) / 2**30,
        "rss_after_build_gib": (process.memory_info().rss - before) / 2**30,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def memory() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = synthetic_tokenizer(Path(tmp) / "data")
        rows = {}
        for dtype in ("float32", "bfloat16"):
            code = (
                "import json, sys; from pathlib import Path; from bench.model.frozen_bf16 import build_once; "
                "print(json.dumps(build_once(sys.argv[1], Path(sys.argv[2]))))"
            )
            done = subprocess.run(
                [sys.executable, "-c", code, dtype, str(tokenizer)], cwd=REPO, capture_output=True, text=True, check=True
            )
            rows[dtype] = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        "| frozen weights held in | frozen GiB | trainable GiB | AdamW state GiB | resident after build, GiB | peak resident, GiB |"
    )
    print("|---|---|---|---|---|---|")
    for dtype, row in rows.items():
        print(
            f"| {dtype} | {row['frozen_gib']:.3f} | {row['trainable_gib']:.3f} | {row['optimizer_state_gib']:.3f} "
            f"| {row['rss_after_build_gib']:.3f} | {row['peak_rss_gib']:.2f} |"
        )


def train_losses(work: Path, tokenizer: Path, data: Path, precision: str, steps: int) -> list[float]:
    out = work / precision
    overrides = [
        *random_init_overrides(tokenizer),
        f"run.output_dir={out}",
        f"data.train_index={data / 'train.jsonl'}",
        "data.val_index=null",
        "data.max_length=48",
        "data.audio_seconds=1.0",
        "data.image_size=224",  # SigLIP-base's input (no processor folder to say so)
        "data.batch_size=2",
        "data.num_workers=0",
        "model.llm.gradient_checkpointing=false",
        "trainer.accumulate_grad_batches=1",
        f"trainer.max_steps={steps}",
        f"trainer.precision={precision}",
        f"checkpoint.every_n_steps={steps}",
        "optim.warmup_steps=2",
        "logging.every_n_steps=1",
        "logging.progress=lines",
        "telemetry.enabled=false",
    ]
    command = [sys.executable, str(REPO / "train_phase2.py"), "--config", str(REAL_CONFIG), *overrides]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench.model.frozen_bf16: the {precision} run failed:\n{done.stderr[-3000:]}")
    with (out / "phase2-qwen2.5-0.5b" / "metrics" / "metrics.csv").open() as handle:
        return [float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")]


def loss(steps: int) -> None:
    from purrsight.data.synthetic import generate

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = generate(work / "data", 64, 2, 0, 64)
        tokenizer = data / "tokenizer"
        fp32 = train_losses(work, tokenizer, data, "32-true", steps)
        bf16 = train_losses(work, tokenizer, data, "bf16-mixed", steps)
    print("| step | 32-true | bf16-mixed, frozen bf16 | difference |")
    print("|---|---|---|---|")
    for step, (a, b) in enumerate(zip(fp32, bf16, strict=True), start=1):
        print(f"| {step} | {a:.4f} | {b:.4f} | {b - a:+.4f} |")
    worst = max(abs(a - b) / a for a, b in zip(fp32, bf16, strict=True))
    print(f"largest relative difference over {steps} steps: {worst:.2%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("memory", "loss"))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    memory() if args.what == "memory" else loss(args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
