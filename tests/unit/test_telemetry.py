from __future__ import annotations

import csv
import subprocess
from pathlib import Path

from purrsight.training.telemetry import flops_per_token
from tests.helpers import DEFAULT_CONFIG, REPO, python_env, tiny_overrides


def test_flops_per_token_matches_a_hand_count() -> None:
    """1 layer, hidden 4, seq 8; N = 100 frozen+LoRA LLM params, T = 10 trainable."""
    # 4N = 400 (forward 2N + input gradients 2N), 2T = 20, attention 12*1*4*8 = 384
    assert flops_per_token(llm_params=100, trainable_params=10, layers=1, hidden=4, seq_len=8) == 804


def test_cpu_run_writes_host_telemetry(synthetic_dir: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [
            "python",
            str(REPO / "train_phase2.py"),
            "--config",
            str(DEFAULT_CONFIG),
            *tiny_overrides(synthetic_dir, tmp_path, trainer__max_steps=20, telemetry__every_n_steps=5, telemetry__barrier_every=5),
        ],
        cwd=REPO,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = list(csv.DictReader((tmp_path / "phase2-tiny" / "telemetry" / "node0.csv").open()))
    assert [int(float(r["step"])) for r in rows] == [5, 10, 15, 20]
    for row in rows:
        assert float(row["samples_per_s"]) > 0 and float(row["tokens_per_s"]) > float(row["samples_per_s"])
        assert 0 <= float(row["data_wait_frac"]) < 1
        assert float(row["rss_gib"]) > 0.05 and float(row["cpu_pct"]) >= 0
        assert "gpu_power_w" not in row  # no NVML on CPU: host metrics only, no error
    metrics = (tmp_path / "phase2-tiny" / "metrics" / "metrics.csv").read_text().splitlines()[0]
    assert "perf/tokens_per_s" in metrics and "perf/data_wait_frac" in metrics
