"""Per-GPU memory of the 7B preset's training on Qwen2.5-7B, 32B and 72B bases, ddp against fsdp,
from ``train_phase2.py estimate`` (purrsight/estimate/); docs/SCALING.md holds the table this prints.

The bases' and towers' shapes are written as config.json files into a temp folder (the real
Qwen2.5 values; SigLIP-base and wav2vec2-base are transformers' defaults): nothing is downloaded and
no weight exists. ``--check`` measures instead: a random model of Qwen2.5-0.5B's shape is saved with
``save_pretrained`` into a temp folder, trained two steps on the CPU with the tiny default's towers
and data (bench/model/train_peak.py: the peak of the tensor bytes alive over the steps), and set beside the estimate for ddp
at 32-true. bench/results/model.md has both results.

    .venv/bin/python -m bench.model.model_memory                 # the table (about a minute)
    .venv/bin/python -m bench.model.model_memory --check         # 0.5B on the CPU (a few minutes, 4 GB)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from transformers import Qwen2Config, SiglipVisionConfig, Wav2Vec2Config

from bench.common import MEASURED_SETTINGS, REPO
from purrsight.config import load_config
from purrsight.estimate.memory import STRATEGIES, footprint

GPUS, GPU_MEMORY = 8, 80 * 10**9
SHARED: dict[str, Any] = {
    "num_key_value_heads": 8,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "max_position_embeddings": 32768,
}
BASES: dict[str, dict[str, Any]] = {  # Qwen2.5's config.json values
    "Qwen2.5-7B": {
        **SHARED,
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
    },
    "Qwen2.5-32B": {**SHARED, "hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 40, "intermediate_size": 27648},
    "Qwen2.5-72B": {**SHARED, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64, "intermediate_size": 29568},
}
QWEN_05B: dict[str, Any] = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}  # fmt: skip


def shapes(folder: Path) -> dict[str, Path]:
    """config.json files of the bases and the 7B preset's towers, in ``folder``."""
    paths = {}
    for name, values in BASES.items():
        Qwen2Config(**values).save_pretrained(folder / name)
        paths[name] = folder / name
    SiglipVisionConfig().save_pretrained(folder / "siglip-base-patch16-224")
    Wav2Vec2Config().save_pretrained(folder / "wav2vec2-base")
    return paths


def table() -> None:
    head = "| base | strategy | frozen | trainable + grads + AdamW | all-gather | activations | logits"
    print(f"{head} | total GB per GPU ({GPUS} GPUs) | on an 80 GB GPU | host GB per node ({GPUS} ranks, at the build) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        bases = shapes(Path(tmp))
        towers = [f"model.image_encoder.path={tmp}/siglip-base-patch16-224", f"model.audio_encoder.path={tmp}/wav2vec2-base"]
        config = load_config(REPO / "config" / "qwen2.5-7b.yaml", [*towers, *MEASURED_SETTINGS], check_paths=False)
        for name, path in bases.items():
            result = footprint(config, path).estimate(GPUS)
            for strategy in STRATEGIES:
                part = result.per_gpu[strategy]
                state = part.trainable + part.gradients + part.optimizer
                cells = [part.frozen, state, part.all_gather, part.activations, part.logits, part.total]
                print(
                    f"| {name} ({result.frozen_parameters / 1e9:.1f}B, {result.trainable_parameters / 1e6:.0f}M trainable, "
                    f"checkpoint {result.checkpoint_bytes / 1e9:.2f} GB) | {strategy} | "
                    + " | ".join(f"{cell / 1e9:.1f}" for cell in cells)
                    + f" | {result.verdict(strategy, GPU_MEMORY)} | {result.host_per_node[strategy] / 1e9:.1f} |"
                )


def check() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        overrides = [
            f"run.output_dir={root}/runs",
            f"data.synthetic_dir={root}/synthetic",
            f"data.train_index={root}/synthetic/train.jsonl",
            f"data.val_index={root}/synthetic/val.jsonl",
            "data.synthetic.num_train=32",
            "data.synthetic.num_val=8",
            "data.batch_size=4",
            "trainer.max_steps=2",
            "trainer.precision=32-true",
            "telemetry.enabled=false",
            "logging.progress=lines",
        ]
        from purrsight.data.synthetic import generate

        generate(root / "synthetic", 32, 8, 0)
        llm = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN_05B), dtype=torch.bfloat16)
        llm.save_pretrained(root / "qwen2.5-0.5b-shape")
        del llm
        overrides += [
            f"model.llm.path={root}/qwen2.5-0.5b-shape",
            "model.llm.config=null",
            f"model.llm.tokenizer={root}/synthetic/tokenizer",
        ]
        config_path = REPO / "config" / "train_config.yaml"
        estimate = footprint(load_config(config_path, overrides)).estimate(1).per_gpu["ddp"]
        done = subprocess.run(
            [sys.executable, "-m", "bench.model.train_peak", "--config", str(config_path), *overrides],
            cwd=REPO, capture_output=True, text=True, check=False,
        )  # fmt: skip
        lines = [line for line in done.stdout.splitlines() if line.startswith("PEAK ")]
        if done.returncode or not lines:
            raise SystemExit(done.stderr[-3000:])
        measured = json.loads(lines[0].split(" ", 1)[1])["held"]
        print(f"estimate (ddp, 32-true, 1 GPU): {estimate.total / 1e9:.3f} GB {estimate}")
        ratio = estimate.total / measured
        print(f"measured (peak tensor bytes over the steps): {measured / 1e9:.3f} GB; estimate / measured = {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="measure the 0.5B shape on the CPU against the estimate")
    if parser.parse_args().check:
        check()
    else:
        table()


if __name__ == "__main__":
    main()
