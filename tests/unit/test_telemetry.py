from __future__ import annotations

import csv
import json
import time
from pathlib import Path

from purrsight.training.telemetry import flops_per_token
from tests.helpers import run_trainer, tiny_overrides


def test_flops_per_token_matches_a_hand_count() -> None:
    """1 layer, hidden 4, seq 8; N = 100 frozen+LoRA LLM params, T = 10 trainable."""
    # 4N = 400 (forward 2N + input gradients 2N), 2T = 20, attention 12*1*4*8 = 384
    assert flops_per_token(llm_params=100, trainable_params=10, layers=1, hidden=4, seq_len=8) == 804


def test_cpu_run_writes_telemetry_report_and_profile(synthetic_dir: Path, tmp_path: Path) -> None:
    done = run_trainer(
        *tiny_overrides(
            synthetic_dir,
            tmp_path,
            trainer__max_steps=20,
            telemetry__every_n_steps=5,
            telemetry__barrier_every=5,
            profiler__enabled="true",
            profiler__start_step=2,
            profiler__end_step=4,
        )
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = list(csv.DictReader((tmp_path / "phase2-tiny" / "telemetry" / "node0.csv").open()))
    assert [int(float(r["step"])) for r in rows] == [1, 5, 10, 15, 20]  # step 1: start-up cost
    times = [float(r["time"]) for r in rows]
    assert times == sorted(times) and abs(times[-1] - time.time()) < 600  # wall clock, in order
    for row in rows:
        assert float(row["samples_per_s"]) > 0 and float(row["tokens_per_s"]) > float(row["samples_per_s"])
        assert 0 <= float(row["data_wait_frac"]) < 1
        assert float(row["rss_gib"]) > 0.05 and float(row["cpu_pct"]) >= 0
        assert "gpu_power_w" not in row  # no NVML on CPU: host metrics only, no error
    metrics = (tmp_path / "phase2-tiny" / "metrics" / "metrics.csv").read_text().splitlines()[0]
    assert "perf/tokens_per_s" in metrics and "perf/data_wait_frac" in metrics

    # the run report and its plots, from the same run
    report = (tmp_path / "phase2-tiny" / "report.md").read_text()
    assert "## Final metrics" in report and "train/loss:" in report and "val/accuracy:" in report
    assert "tokens/s (job)" in report and "energy per sample: not measured (no NVML)" in report
    for plot in ("loss.png", "throughput.png"):
        assert (tmp_path / "phase2-tiny" / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({plot})" in report
    assert not (tmp_path / "phase2-tiny" / "power.png").exists()  # no power without NVML: no empty plot
    # the profiler window
    trace = json.loads((tmp_path / "phase2-tiny" / "profiler" / "rank0.json").read_text())
    assert any("aten::" in event.get("name", "") for event in trace["traceEvents"])
