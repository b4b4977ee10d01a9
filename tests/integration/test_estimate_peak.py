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
    """The tiny default trained two steps on the CPU (bench/model/train_peak.py: the bytes of every
    tensor storage alive, read after every op of the steps) against the estimate for ddp at
    32-true on one device: within 25% either way.

    ``data.max_length`` 24 is at least every synthetic sample's length, so the estimate's worst
    case (every sample at the maximum) is the batch the run trains. Until 2026-11-27 the measure
    was malloc's bytes in use, which counts the BLAS's and oneDNN's own first-call buffers (18 MiB
    in the tiny default's first forward on one machine, 4 on another: their size follows the CPU's
    instruction set): it passed on one machine and failed on the next."""
    overrides = tiny_overrides(
        synthetic_dir, tmp_path, trainer__max_steps=2, trainer__precision="32-true", telemetry__enabled="false", data__max_length=24
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
    assert 0.8 * held <= estimate <= 1.25 * held, f"estimate {estimate / 2**20:.2f} MiB, measured {held / 2**20:.2f} MiB"
