"""metrics.csv (purrsight/observability/loggers.py): a run's history kept whole across resumes and kills.

Each test drives the real CSV logger the trainer builds (RunCSVLogger's writer) on a real file.
"""

from __future__ import annotations

import csv
import signal
import subprocess
import sys
from pathlib import Path

from purrsight.atomic_file import stale_temp_files
from purrsight.observability.loggers import RunCSVLogger
from tests.helpers import REPO, python_env, read_metrics


def write_history(run_dir: Path, steps: int) -> Path:
    """A metrics.csv as training leaves it: a row per logged step, Lightning's sorted header."""
    path = run_dir / "metrics" / "metrics.csv"
    path.parent.mkdir(parents=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["epoch", "step", "train/loss"])
        writer.writeheader()
        writer.writerows({"epoch": "0", "step": str(step), "train/loss": f"{5 - step / 10:.4f}"} for step in range(1, steps + 1))
    return path


# The writer a resumed run makes, then the first validation's key (val/loss) that widens the
# header; the kernel kills the process half way through that write (SIGXFSZ at a file-size limit
# of half the history: Python ignores the signal, so its default is set back first).
NEW_KEY_KILLED_MID_WRITE = """
import resource, signal, sys
from pathlib import Path
from purrsight.observability.loggers import RunCSVLogger

writer = RunCSVLogger(Path(sys.argv[1]), resumed_step=20).experiment
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
writer.log_metrics({"train/loss": 2.0, "val/loss": 2.5, "epoch": 0}, step=21)
writer.save()
"""


def test_a_kill_while_a_new_key_widens_the_header_keeps_the_whole_history_and_the_next_start_removes_the_copy(
    tmp_path: Path,
) -> None:
    """Lightning rewrote metrics.csv in place for a new key: killed then, the run lost its history.
    What the kill leaves is a temp file with a copy of the history (as large as the history), which
    the next start removed never: a kill at each rewrite added one."""
    path = write_history(tmp_path, 20)
    before = read_metrics(tmp_path)
    args = [sys.executable, "-c", NEW_KEY_KILLED_MID_WRITE, str(tmp_path), str(path.stat().st_size // 2)]
    killed = subprocess.run(args, cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGXFSZ, killed.stderr[-2000:]
    assert read_metrics(tmp_path) == before  # before the fix: cut to the rows written before the kill
    (torn,) = stale_temp_files(path.parent)
    assert torn.name.startswith(".metrics.csv.")
    assert RunCSVLogger(tmp_path, resumed_step=20).experiment is not None  # the next attempt's writer, at its start
    assert not torn.exists() and stale_temp_files(path.parent) == []
    assert read_metrics(tmp_path) == before


def test_rows_are_appended_and_a_new_key_publishes_one_table_with_every_row(tmp_path: Path) -> None:
    path = write_history(tmp_path, 4)
    writer = RunCSVLogger(tmp_path, resumed_step=4).experiment
    writer.log_metrics({"train/loss": 4.0, "epoch": 0}, step=5)
    writer.save()
    inode = path.stat().st_ino
    writer.log_metrics({"train/loss": 3.9, "epoch": 0}, step=6)
    writer.save()
    assert path.stat().st_ino == inode  # known keys: appended, the file is not rewritten
    writer.log_metrics({"train/loss": 3.8, "val/loss": 3.7, "epoch": 0}, step=7)
    writer.save()
    assert path.stat().st_ino != inode  # a new key: a new file renamed over the old, not a rewrite in place
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [str(step) for step in range(1, 8)]
    assert [row["val/loss"] for row in rows] == [""] * 6 + ["3.7"] and rows[0]["train/loss"] == "4.9000"
    assert path.read_text().count("step") == 1 and not stale_temp_files(path.parent)  # one header


def test_a_last_line_torn_by_a_kill_is_cut_before_the_resumed_run_appends(tmp_path: Path) -> None:
    """A process killed mid-append leaves a line without its newline; the next row would be glued to it."""
    path = write_history(tmp_path, 3)
    whole = read_metrics(tmp_path)
    with path.open("a") as handle:
        handle.write("0,4,4.6")  # step 4's row, cut short: its last digits and newline missing
    # Resumed at step 4 (its checkpoint was saved before the flush that the kill cut): the
    # history keeps rows up to 4, so the torn one is not dropped as a later row would be.
    writer = RunCSVLogger(tmp_path, resumed_step=4).experiment
    writer.log_metrics({"train/loss": 4.6, "epoch": 0}, step=4)
    writer.save()
    rows = read_metrics(tmp_path)
    assert rows[:3] == whole and rows[3] == {"epoch": "0", "step": "4", "train/loss": "4.6"} and len(rows) == 4
