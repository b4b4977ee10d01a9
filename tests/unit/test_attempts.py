"""Effective training time (purrsight/runs/attempts.py): how attempts split the wall time."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from purrsight.atomic_file import stale_temp_files
from purrsight.runs.attempts import Attempt, plot_timeline, summarize, summary_lines
from tests.helpers import REPO, python_env


def test_a_killed_attempt_a_requeue_and_a_finish_add_up_to_the_wall_time(tmp_path: Path) -> None:
    killed = Attempt(
        number=1, how="first start", launched_at=0.0, resumed_step=0, world_size=4, global_batch="4 x 8 x 2 = 64",
        first_step_at=60.0, last_step=100, last_step_at=1055.0, checkpoint_s=20.0, updated_at=1060.0,
    )  # fmt: skip
    # requeued 600 s after the last heartbeat; resumed from step 80: steps 81-100 were lost
    finished = Attempt(
        number=2, how="new launch, resumed", launched_at=1660.0, resumed_step=80, world_size=2, global_batch=None,
        first_step_at=1700.0, last_step=200, last_step_at=2900.0, checkpoint_s=10.0, updated_at=2900.0,
        training_ended_at=2904.0, ended_at=2910.0, end="finished",
    )  # fmt: skip
    summary = summarize([killed, finished])
    first, second = summary.splits
    assert summary.wall == 2910.0
    assert first.startup == 60.0 and first.checkpoint == 20.0
    assert first.lost == pytest.approx(980.0 * 20 / 100) and first.training == pytest.approx(980.0 * 80 / 100)
    assert first.end == "killed (no end recorded)"
    assert second.waiting_before == 600.0 and second.startup == 40.0 and second.lost == 0.0
    assert second.training == pytest.approx(2904.0 - 1700.0 - 10.0) and second.wind_down == 6.0
    assert first.wind_down == 0.0  # killed: no end recorded
    assert sum(split.total for split in summary.splits) == pytest.approx(summary.wall)
    assert summary.effective == pytest.approx((784.0 + 1194.0) / 2910.0)
    lines = summary_lines(summary)
    assert lines[0] == "Effective training time: **68.0%** of 48 min 30 s wall time, over 2 attempt(s)."
    row = (
        "| 1 | first start | 0 -> 100 | 4 x 8 x 2 = 64 | 0.0 s | 60.0 s | 13 min 04 s | 20.0 s | 3 min 16 s | 0.0 s "
        "| killed (no end recorded) |"
    )
    assert row in lines
    assert any(line.startswith("| 2 | new launch, resumed | 80 -> 200 | - |") for line in lines)  # a record without one
    assert "| wind-down (trackers closing, report, exit) | 6.0 s | 0.2% |" in lines
    assert plot_timeline(summary, tmp_path / "attempts.png") == tmp_path / "attempts.png"


# The timeline drawn anew over the last one, the process killed by the kernel half way through the
# PNG (SIGXFSZ at a file-size limit; Python ignores the signal, so its default is set back first).
PLOT_KILLED_MID_WRITE = """
import resource, signal, sys
from pathlib import Path
import matplotlib.pyplot  # before the limit: its font cache is written at the first import
from purrsight.runs.attempts import Attempt, plot_timeline, summarize

attempt = Attempt(
    number=1, how="first start", launched_at=0.0, resumed_step=0, world_size=1,
    first_step_at=5.0, last_step=10, last_step_at=60.0, checkpoint_s=1.0, updated_at=60.0,
)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))
plot_timeline(summarize([attempt]), Path(sys.argv[1]))
"""


def test_a_timeline_killed_mid_write_leaves_the_last_whole_one(tmp_path: Path) -> None:
    """attempts.png was written in place (savefig to its path): a kill cut it to what was written."""
    last = tmp_path / "attempts.png"
    last.write_bytes(b"the last whole picture")
    args = [sys.executable, "-c", PLOT_KILLED_MID_WRITE, str(last)]
    killed = subprocess.run(args, cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGXFSZ, killed.stderr[-2000:]
    assert last.read_bytes() == b"the last whole picture"
    (torn,) = stale_temp_files(tmp_path, "attempts.png")  # what the report's next start removes
    assert torn.stat().st_size == 2000


def test_the_attempt_record_is_written_right_after_each_checkpoint(tmp_path: Path) -> None:
    """CheckpointSaver.after_save calls the recorder: the record on disk names the saved step and the
    time spent saving at once, not at the next heartbeat (a kill in between lost them)."""
    import json
    from types import SimpleNamespace

    from purrsight.runs.attempts import ATTEMPTS_DIR, AttemptRecorder

    seconds = [0.0]
    recorder = AttemptRecorder(tmp_path, 0, lambda: seconds[0])
    trainer = SimpleNamespace(is_global_zero=True, global_step=0, world_size=1)
    recorder.on_train_start(trainer, None)  # type: ignore[arg-type]
    trainer.global_step, seconds[0] = 7, 1.5
    recorder.on_train_batch_end(trainer)  # type: ignore[arg-type]  # the first step: written
    trainer.global_step, seconds[0] = 8, 2.25
    recorder.on_train_batch_end(trainer)  # type: ignore[arg-type]  # within the heartbeat: not written
    (record,) = (tmp_path / ATTEMPTS_DIR).glob("attempt-*.json")
    assert json.loads(record.read_text())["last_step"] == 7
    recorder.after_save(trainer)  # type: ignore[arg-type]
    written = json.loads(record.read_text())
    assert written["last_step"] == 8 and written["checkpoint_s"] == 2.25
