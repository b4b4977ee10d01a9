"""Hostile strings are data, never code; secrets never reach a log in clear."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.helpers import DEFAULT_CONFIG, REPO, launcher_env, tiny_overrides

HOSTILE = "x $(touch PWNED_A) `touch PWNED_B`; touch PWNED_C 'q\" y"


def test_hostile_config_path_and_override_are_never_executed(synthetic_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / f"cfg {HOSTILE}.yaml"
    shutil.copy(DEFAULT_CONFIG, config)
    env = launcher_env(
        tmp_path / "logs", LOG_LEVEL="DEBUG", HF_TOKEN="hf_supersecret_value", MY_PASSWORD="hunter2", OMP_NUM_THREADS="1"
    )
    overrides = [*tiny_overrides(synthetic_dir, tmp_path / "runs", trainer__max_steps=3), f"run.name=run {HOSTILE}"]
    dry = subprocess.run(
        ["./cluster_train.sh", "--dry-run", str(config), "--", *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dry.returncode == 0, dry.stderr
    done = subprocess.run(
        ["./cluster_train.sh", str(config), "--", *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    for folder in (REPO, tmp_path, Path.cwd()):
        assert not list(folder.glob("PWNED_*")), folder
    assert (tmp_path / "runs" / f"run {HOSTILE}" / "checkpoints" / "last.ckpt").exists()  # the name is just a name
    log = (tmp_path / "logs" / "latest_node0.log").read_text()
    assert "HF_TOKEN=****" in log and "MY_PASSWORD=****" in log
    assert "hf_supersecret_value" not in log + dry.stdout and "hunter2" not in log + dry.stdout
