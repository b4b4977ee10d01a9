"""The run-folder rules: one run per folder, nothing deleted unless asked, history kept to the resume."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from purrsight.run_folder import (
    RunFolderError,
    clear_for_new_run,
    existing_run,
    launched_here,
    record_launch,
    truncate_history,
)


def make_run(run_dir: Path, steps: tuple[int, ...] = (50, 100)) -> None:
    (run_dir / "checkpoints").mkdir(parents=True)
    for step in steps:
        (run_dir / "checkpoints" / f"step-{step:08d}.ckpt").write_bytes(b"weights")
    (run_dir / "metrics").mkdir()
    (run_dir / "metrics" / "metrics.csv").write_text("step,train/loss\n10,3.0\n")


def test_what_counts_as_a_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    assert existing_run(run_dir) is None
    (run_dir / "telemetry").mkdir(parents=True)  # telemetry alone: a start that never got anywhere
    assert existing_run(run_dir) is None
    make_run(run_dir)
    assert existing_run(run_dir) == "checkpoints up to step 100 and a metrics history in metrics/metrics.csv"


def test_a_new_run_into_a_used_folder_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    make_run(run_dir)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(RunFolderError) as refused:
        clear_for_new_run(run_dir, "refuse")
    message = str(refused.value)
    for choice in ("--resume", "RESUME=auto", "run.name=", "run.if_exists=archive", "run.if_exists=overwrite", str(run_dir)):
        assert choice in message
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_archive_keeps_the_old_run_beside_and_overwrite_deletes_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    make_run(run_dir)
    clear_for_new_run(run_dir, "archive")
    (archived,) = tmp_path.glob("r.archived-*")
    assert (archived / "checkpoints" / "step-00000100.ckpt").read_bytes() == b"weights"
    assert (archived / "metrics" / "metrics.csv").read_text().endswith("10,3.0\n")
    assert not run_dir.exists()
    make_run(run_dir)
    clear_for_new_run(run_dir, "overwrite")
    assert not run_dir.exists() and archived.is_dir()  # only what overwrite was pointed at


def test_truncate_history_keeps_rows_through_the_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    assert truncate_history(path, 5) == []
    path.write_text("epoch,step,val/loss\n0,10,\n0,20,1.5\n1,30,\n1,40,1.2\n")
    assert truncate_history(path, 20) == ["epoch", "step", "val/loss"]
    with path.open() as handle:
        assert [row["step"] for row in csv.DictReader(handle)] == ["10", "20"]
    truncate_history(path, 0)
    assert path.read_text().splitlines() == ["epoch,step,val/loss"]


def test_launch_marker(tmp_path: Path) -> None:
    assert not launched_here(tmp_path / "r", "a")
    record_launch(tmp_path / "r", "a")
    assert launched_here(tmp_path / "r", "a") and not launched_here(tmp_path / "r", "b")
