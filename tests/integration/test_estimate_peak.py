"""``train_phase2.py estimate`` against the peak a real training run holds on the CPU (issue 44, part 6).

The 0.5B shape's comparison is bench/model/model_memory.py --check's (bench/results/model.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import DEFAULT_CONFIG, REPO, tiny_overrides


def test_the_estimate_is_near_the_peak_a_cpu_run_holds(synthetic_dir: Path, tmp_path: Path) -> None:
    """The tiny default trained two steps on the CPU (bench/model/train_peak.py: glibc's bytes in use,
    read after every op of the steps, less the figure before the run) against the estimate for
    ddp at 32-true on one device. Margin: the estimate is at least the measured peak less 16 MiB
    (what the run keeps in malloc that is no tensor: Lightning, the loader, the tokenizer; 9 MiB
    here when written) and at most 1.25 times it."""
    overrides = tiny_overrides(
        synthetic_dir, tmp_path, trainer__max_steps=2, trainer__precision="32-true", telemetry__enabled="false"
    )
    estimate = json.loads(
        subprocess.run(
            [sys.executable, "train_phase2.py", "estimate", "--json", *overrides],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )["per_gpu_bytes"]["ddp"]["total"]
    done = subprocess.run(
        [sys.executable, "-m", "bench.model.train_peak", "--config", str(DEFAULT_CONFIG), *overrides],
        cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("PEAK ")]
    held = json.loads(line.split(" ", 1)[1])["held"]
    assert held - 16 * 2**20 <= estimate <= 1.25 * held, f"estimate {estimate / 2**20:.1f} MiB, measured {held / 2**20:.1f} MiB"
