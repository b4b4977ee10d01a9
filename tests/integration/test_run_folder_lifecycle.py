"""One run folder across several invocations, as a user meets it (real trainer subprocesses).

A second run into the same folder, a resume, a resume from an older checkpoint, a
checkpoint that cannot be read: each keeps one run's work whole and its history in one
numbering (docs/RELIABILITY.md, "Run folders").
"""

from __future__ import annotations

import csv
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import DEFAULT_CONFIG, REPO, free_port, python_env, read_metrics, run_python, tiny_overrides, train_tiny
from tests.preloaded import PreloadedTrainer


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by relative path, with its content digest."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def logged_steps(run_dir: Path, metric: str) -> list[int]:
    return [int(float(row["step"])) for row in read_metrics(run_dir) if row.get(metric)]


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*.ckpt"))


def test_a_second_run_into_the_folder_is_refused_until_asked(
    synthetic_dir: Path, tmp_path_with_a_finished_run: Path, preloaded_trainer: PreloadedTrainer
) -> None:
    tmp_path = tmp_path_with_a_finished_run
    run_dir = tmp_path / "phase2-tiny"
    before = snapshot(run_dir)

    again = train_tiny(synthetic_dir, tmp_path, preloaded=preloaded_trainer, trainer__max_steps=10)
    assert again.returncode == 2
    assert (
        again.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: run folder {run_dir} already holds a run (checkpoints up to step 20 and a metrics history")
    )
    assert "Traceback" not in again.stderr
    assert snapshot(run_dir) == before  # nothing written, nothing deleted

    archived = train_tiny(synthetic_dir, tmp_path, preloaded=preloaded_trainer, trainer__max_steps=10, run__if_exists="archive")
    assert archived.returncode == 0, archived.stderr[-3000:]
    (old,) = tmp_path.glob("phase2-tiny.archived-*")
    assert snapshot(old) == before  # the earlier run, whole, beside the new one
    assert checkpoint_steps(run_dir) == [10]  # the new run's checkpoint is kept, not rotated away
    assert (run_dir / "checkpoints" / "last.ckpt").samefile(run_dir / "checkpoints" / "step-00000010.ckpt")
    assert logged_steps(run_dir, "train/loss") == [5, 10]

    overwritten = train_tiny(synthetic_dir, tmp_path, preloaded=preloaded_trainer, trainer__max_steps=5, run__if_exists="overwrite")
    assert overwritten.returncode == 0, overwritten.stderr[-3000:]
    assert checkpoint_steps(run_dir) == [5] and logged_steps(run_dir, "train/loss") == [5]
    assert snapshot(old) == before


def test_resumes_continue_one_history_in_one_numbering(
    synthetic_dir: Path, tmp_path: Path, preloaded_trainer: PreloadedTrainer
) -> None:
    """Metrics, TensorBoard and telemetry keep the rows before the resumed step and redo the rows after it.

    Steps are counted as finished optimizer steps everywhere: logging every 5 steps gives
    5, 10, ... in metrics.csv, TensorBoard and the progress lines (Lightning's own count
    gave 4, 9, ...).
    """
    common = {"logging__tensorboard": "true", "checkpoint__keep_last": 5}
    run_dir = tmp_path / "phase2-tiny"
    assert train_tiny(synthetic_dir, tmp_path, preloaded=preloaded_trainer, **common).returncode == 0
    resumed = train_tiny(synthetic_dir, tmp_path, "--resume", preloaded=preloaded_trainer, trainer__max_steps=30, **common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step 25/30" in resumed.stderr
    assert logged_steps(run_dir, "train/loss") == [5, 10, 15, 20, 25, 30]
    assert logged_steps(run_dir, "val/loss") == [10, 20, 30]
    assert tensorboard_steps(run_dir, "train/loss") == [5, 10, 15, 20, 25, 30]
    assert telemetry_steps(run_dir) == [1, 10, 20, 30]
    assert "- val/accuracy:" in (run_dir / "report.md").read_text()

    # Back to step 10: the later checkpoints are set aside (not deleted), the history is cut back to 10.
    older = run_dir / "checkpoints" / "step-00000010.ckpt"
    again = train_tiny(
        synthetic_dir, tmp_path, "--resume", str(older), preloaded=preloaded_trainer, trainer__max_steps=20, **common
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert checkpoint_steps(run_dir) == [10, 20]
    (aside,) = (run_dir / "checkpoints").glob("superseded-*")
    assert sorted(p.name for p in aside.glob("step-*.ckpt")) == ["step-00000020.ckpt", "step-00000030.ckpt"]
    assert logged_steps(run_dir, "train/loss") == [5, 10, 15, 20]
    assert logged_steps(run_dir, "val/loss") == [10, 20]
    assert tensorboard_steps(run_dir, "train/loss") == [5, 10, 15, 20]
    assert telemetry_steps(run_dir) == [1, 10, 20]


def tensorboard_steps(run_dir: Path, tag: str) -> list[int]:
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()  # applies the purge a resumed writer asked for, as TensorBoard's UI does
    return [event.step for event in events.Scalars(tag)]


def telemetry_steps(run_dir: Path) -> list[int]:
    with (run_dir / "telemetry" / "node0.csv").open(newline="") as handle:
        return [int(float(row["step"])) for row in csv.DictReader(handle)]


def test_a_checkpoint_that_cannot_be_read_stops_the_resume(synthetic_dir: Path, tmp_path_with_a_finished_run: Path) -> None:
    """Permission denied on the newest checkpoint: exit 2 naming it, not a silent resume from an older one.

    As root (CI), permission bits do not stop a read; setpriv drops the capabilities that
    bypass them (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH), so the denial is the kernel's own.
    """
    tmp_path = tmp_path_with_a_finished_run
    run_dir = tmp_path / "phase2-tiny"
    newest = run_dir / "checkpoints" / "step-00000020.ckpt"
    newest.chmod(0)
    before = snapshot_names(run_dir)
    prefix = ("setpriv", "--bounding-set=-dac_override,-dac_read_search") if os.geteuid() == 0 else ()
    args = [
        str(REPO / "train_phase2.py"),
        "--config",
        str(DEFAULT_CONFIG),
        *tiny_overrides(synthetic_dir, tmp_path, trainer__max_steps=30),
    ]
    result = run_python(args, env={"PURRSIGHT_RESUME": "auto"}, prefix=prefix)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: cannot read checkpoint {newest}: Permission denied; fix access to it (or move it away) and start again"
    )
    assert "resuming from" not in result.stderr
    assert snapshot_names(run_dir) == before


def snapshot_names(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_torchrun_restarts_of_a_refused_start_refuse_again(synthetic_dir: Path, tmp_path_with_a_finished_run: Path) -> None:
    """Plain torchrun (no launcher pre-check) with --max-restarts 1 into a folder holding a run.

    The refused worker exits 2 and torchrun starts it again as a restart; a restart resumes
    by itself, so without the launch marker it would quietly continue the run it was refused.
    """
    tmp_path = tmp_path_with_a_finished_run
    run_dir = tmp_path / "phase2-tiny"
    before = snapshot(run_dir)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--max-restarts", "1"]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    script = [str(REPO / "train_phase2.py"), "--config", str(DEFAULT_CONFIG)]
    overrides = tiny_overrides(synthetic_dir, tmp_path, trainer__max_steps=30)
    result = subprocess.run([*torchrun, *script, *overrides], env=python_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1  # plain torchrun's own code for any failed worker (the launcher reports 2)
    assert result.stderr.count(f"error: run folder {run_dir} already holds a run") == 2, result.stderr[-3000:]
    assert "torchrun restart 1: this launch has not trained" in result.stderr
    assert "resuming from" not in result.stderr
    assert snapshot(run_dir) == before
