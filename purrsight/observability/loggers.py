"""Metrics loggers that number steps as the rest of the run does and continue a resumed history.

Step numbers: purrsight/observability/step_numbering.py. Trackers (MLflow, W&B): trackers.py.

History. Lightning's CSV writer deletes ``metrics.csv`` when it starts, so a resumed run
(by hand, RESUME=auto, a torchrun restart, a SLURM requeue) lost every row before the
resume, and it rewrites the file in place when a new key appears, so a kill then cut the
run's history. Here the rows up to the resumed step stay and later ones (redone now) are
replaced, rows are only appended, and a wider header is published whole (``_ContinuingWriter``);
TensorBoard is told to drop its own later events (``purge_step``).
"""

from __future__ import annotations

import csv
import importlib.util
import io
import logging
import os
from pathlib import Path
from typing import Any

from lightning_fabric.loggers.csv_logs import _ExperimentWriter as _FabricExperimentWriter
from pytorch_lightning.loggers import CSVLogger, Logger, TensorBoardLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter
from pytorch_lightning.loggers.logger import rank_zero_experiment

from purrsight.atomic_file import remove_stale_temp_files, write_atomically, write_text_atomically
from purrsight.config import Config, ConfigError
from purrsight.observability.step_numbering import RunStepNumbering
from purrsight.observability.trackers import build_trackers
from purrsight.run_folder import truncate_history

log = logging.getLogger(__name__)


class _ContinuingWriter(ExperimentWriter):
    """Lightning's CSV writer, continuing one run's ``metrics.csv`` and never rewriting it in place.

    - At start the rows up to ``through_step`` stay (Lightning's deletes the file), and a last
      line torn by a kill mid-append is cut: appended to, it would merge with the next row.
    - Rows are appended under the header the file has.
    - A key the header lacks (``val/loss`` at the first validation) needs a wider header. The
      file is then written anew, earlier rows and new ones under the wider header, through
      atomic_file.py: a kill leaves the old file or the new one, never the truncated one that
      Lightning's in-place rewrite left. A new section with its own header, appended, would
      need no rewrite, but csv.DictReader and pandas read one header per file; one table is
      what readers (tests/helpers.read_metrics, the report) take, and the rewrite happens once
      per new key, not per save.
    """

    def __init__(self, log_dir: str, through_step: int) -> None:
        self._through_step = through_step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:  # Lightning's deletes metrics.csv here
        path = Path(self.metrics_file_path)
        # Rank 0 alone writes it; a temp a kill left is a whole copy of the history, never read again.
        for stale in remove_stale_temp_files(path.parent, path.name):
            log.warning("removed %s, left by a run killed while it rewrote %s", stale, path)
        _cut_torn_last_line(path)
        self.metrics_keys = truncate_history(path, self._through_step)  # the kept rows' columns

    def save(self) -> None:
        if not self.metrics:
            return
        path = Path(self.metrics_file_path)
        if self._record_new_keys() or not path.is_file():
            self._publish_whole(path)
        else:
            self._append(path)
        self.metrics = []

    def _append(self, path: Path) -> None:
        with path.open("a", newline="") as handle:
            csv.DictWriter(handle, fieldnames=self.metrics_keys).writerows(self.metrics)
            handle.flush()
            os.fsync(handle.fileno())  # once per flush (every 100 steps): the rows survive a power cut

    def _publish_whole(self, path: Path) -> None:
        earlier: list[dict[str, str]] = []
        if path.is_file():
            with path.open(newline="") as handle:
                earlier = list(csv.DictReader(handle))
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=self.metrics_keys)
        writer.writeheader()
        writer.writerows(earlier)
        writer.writerows(self.metrics)
        write_text_atomically(path, text.getvalue())


def _cut_torn_last_line(path: Path) -> None:
    """Remove a last line without its newline: what a process killed mid-append leaves."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb") as handle:
        handle.seek(-1, os.SEEK_END)
        if handle.read(1) == b"\n":
            return
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    write_atomically(path, whole)
    log.warning("%s: removed a torn last line (%d bytes), left by a run killed while writing it", path, len(data) - len(whole))


class RunCSVLogger(RunStepNumbering, CSVLogger):
    def __init__(self, run_dir: Path, resumed_step: int) -> None:
        super().__init__(save_dir=str(run_dir), name="metrics", version="")
        self._resumed_step = resumed_step

    @property
    @rank_zero_experiment
    def experiment(self) -> _FabricExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuingWriter(self.log_dir, self._resumed_step)
        return self._experiment


class RunTensorBoardLogger(RunStepNumbering, TensorBoardLogger):
    def __init__(self, run_dir: Path, resumed_step: int) -> None:
        # purge_step: TensorBoard hides the earlier files' events from this step on (redone now).
        super().__init__(save_dir=str(run_dir), name="tensorboard", version="", purge_step=resumed_step + 1)


def build_loggers(config: Config, run_dir: Path, resumed_step: int) -> list[Logger]:
    loggers: list[Any] = []
    if config.logging.csv:
        loggers.append(RunCSVLogger(run_dir, resumed_step))
    if config.logging.tensorboard:
        # Lightning would fail only once training starts, with a traceback; say it now.
        if not any(importlib.util.find_spec(package) for package in ("tensorboard", "tensorboardX")):
            raise ConfigError(
                [
                    "logging.tensorboard is true but the tensorboard package is not installed: "
                    "pip install -e .[tensorboard], or set logging.tensorboard=false"
                ]
            )
        loggers.append(RunTensorBoardLogger(run_dir, resumed_step))
    return loggers + build_trackers(config, run_dir)
