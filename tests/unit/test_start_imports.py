"""What a trainer imports before its first step: nothing for a feature that is off.

A trainer's start is 88% imports (bench/results/launch.md, 2026-11-27), and each package a path
does not need costs every worker, every restart and every test that starts one. The tiny default
(no tracker, no Ray, no prepared set, no compile, no profiler, ddp) is trained to its first step
in a fresh interpreter, and the modules loaded by then are listed; an import of a feature that is
off creeping onto that path fails here, naming the module.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import DEFAULT_CONFIG, REPO, python_env, tiny_overrides

# Features the tiny default does not use, and the modules that only they need.
OFF_FEATURES = {
    "mlflow": "the MLflow tracker (logging.mlflow_tracking_uri unset)",
    "wandb": "the W&B tracker (logging.wandb_project unset)",
    "ray": "the Ray engine (--engine torchrun)",
    "datasets": "Hugging Face datasets (no prepared set is made at training time)",
    "tensorboard": "TensorBoard (not a logger of ours)",
    "pynvml": "NVML power telemetry (no GPU)",
    "torch._inductor.codegen": "torch.compile (trainer.compile false)",
    "purrsight.ray_engine": "the Ray engine",
    "purrsight.ray_node": "Ray inside a batch job",
    "purrsight.estimate": "train_phase2.py estimate",
    "purrsight.datasets.prepare_job": "train_phase2.py prepare",
    "purrsight.training.export": "train_phase2.py export",
    "purrsight.data.formats.parquet_shards": "Parquet sources (the index is our JSONL)",
    "purrsight.data.formats.tar_shards": "WebDataset tars (the index is our JSONL)",
}

PROBE = """
import json, sys
import pytorch_lightning as pl
from purrsight.config import load_config
from purrsight.training.run import train

seen = []
class FirstStep(pl.Callback):
    def on_train_batch_end(self, *args):
        seen.append(sorted(sys.modules)) if not seen else None
train(load_config(sys.argv[1], sys.argv[2:]), callbacks=[FirstStep()])
print("MODULES " + json.dumps(seen[0]))
"""


def test_the_tiny_default_imports_nothing_for_a_feature_that_is_off(synthetic_dir: Path, tmp_path: Path) -> None:
    overrides = tiny_overrides(synthetic_dir, tmp_path, trainer__max_steps=1, trainer__val_every_n_steps=1000)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(DEFAULT_CONFIG), *overrides],
        cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("MODULES ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    loaded = set(json.loads(lines[0].split(" ", 1)[1]))
    assert "purrsight.training.run" in loaded and "transformers" in loaded  # the probe saw the real start
    crept = [
        f"{name} ({feature})"
        for name, feature in OFF_FEATURES.items()
        if name in loaded or any(module.startswith(name + ".") for module in loaded)
    ]
    assert not crept, "imported before the first step for a feature that is off: " + ", ".join(crept)
