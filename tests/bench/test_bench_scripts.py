"""The benchmark scripts still run (they are run by hand, so nothing else would notice them rot).

These check that each script trains or loads and prints its table; they assert no speed:
figures from a 2-core CI machine mean nothing, and bench/README.md holds the measured ones.
"""

from __future__ import annotations

import re
from pathlib import Path

from bench.common import run_plain
from tests.helpers import run_python


def table_rows(output: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in output.splitlines() if re.match(r"\| \d", line)]


def test_gpu_script_smoke_run_on_cpu() -> None:
    """--smoke builds the model through build_model and trains it on CPU: the GPU path minus CUDA."""
    done = run_python(["-m", "bench.gpu_throughput", "--smoke"], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = table_rows(done.stdout)
    assert [row[0] for row in rows] == ["16", "32"]
    assert all(float(row[2]) > 0 for row in rows)  # tokens/s


def test_data_pipeline_script_small_run() -> None:
    done = run_python(
        [
            "-m",
            "bench.data_pipeline",
            "--samples",
            "24",
            "--large-samples",
            "16",
            "--workers",
            "1",
            "--batches",
            "2",
            "--repeats",
            "1",
        ],
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    consumption = re.search(r"one H100 at 40% MFU consumes ([\d.]+) samples/s \(([\d.]+) TFLOP per sample\)", done.stdout)
    assert consumption, done.stdout
    # 1088 tokens x about 2.3 GFLOP per token (4 x 0.5B parameters, plus attention), plus the towers
    assert 1.5 < float(consumption.group(2)) < 4
    workers, *side_by_side = table_rows(done.stdout)
    assert workers[0] == "1" and float(workers[1]) > 0
    assert [row[0] for row in side_by_side] == ["224 px", "4000x3000", "224 px + 5-min 44.1 kHz stereo audio"]
    assert all(float(row[2]) > 0 for row in side_by_side)
    assert re.search(r"a 4000x3000 JPEG costs [\d.]+x a 224-px one", done.stdout)


def test_plain_ddp_loop_on_two_ranks(tmp_path: Path) -> None:
    timing = run_plain(nproc=2, steps=40, per_process_batch=8, work=tmp_path)
    assert timing.first_step_s > 0 and timing.samples_per_s > 0
