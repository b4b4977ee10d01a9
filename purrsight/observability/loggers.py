"""Metrics loggers that number steps as the rest of the run does and continue a resumed history.

Step numbers: purrsight/observability/step_numbering.py. Trackers (MLflow, W&B): trackers.py.

History. Lightning's CSV writer deletes ``metrics.csv`` when it starts, so a resumed run
(by hand, RESUME=auto, a torchrun restart, a SLURM requeue) lost every row before the
resume. Here the rows up to the resumed step stay and later ones (redone now) are
replaced; TensorBoard is told to drop its own later events (``purge_step``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from lightning_fabric.loggers.csv_logs import _ExperimentWriter as _FabricExperimentWriter
from pytorch_lightning.loggers import CSVLogger, Logger, TensorBoardLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter
from pytorch_lightning.loggers.logger import rank_zero_experiment

from purrsight.config import Config, ConfigError
from purrsight.observability.step_numbering import RunStepNumbering
from purrsight.observability.trackers import build_trackers
from purrsight.run_folder import truncate_history


class _ContinuingWriter(ExperimentWriter):
    """Lightning's CSV writer, keeping the earlier rows up to ``through_step`` instead of deleting the file."""

    def __init__(self, log_dir: str, through_step: int) -> None:
        self._through_step = through_step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:  # Lightning's deletes metrics.csv here
        # The kept rows' columns: new ones are added by Lightning's header rewrite.
        self.metrics_keys = truncate_history(Path(self.metrics_file_path), self._through_step)


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
