"""One step numbering for every metrics logger: the count of optimizer steps finished.

Lightning hands a logger the count of optimizer steps finished *before* the step being
logged, so the 10th step's loss landed at step 9 while the progress lines, telemetry and
checkpoint names say 10. During fit these loggers add one; a validation after fit is logged
at the step count as it stands.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_only


class RunStepNumbering:
    """Mixin for a Lightning logger: steps counted as finished steps, one numbering everywhere."""

    step_offset = 0  # set to 1 for the fit by FitStepNumbering

    @rank_zero_only
    def log_metrics(self, metrics: Any, step: int | None = None) -> None:  # Any: CSV and TensorBoard annotate it apart
        shifted = None if step is None else step + self.step_offset
        super().log_metrics(metrics, shifted)  # type: ignore[misc]  # the Lightning logger this is mixed into


class FitStepNumbering(pl.Callback):
    """Turns the loggers' +1 on for the fit and off after it (a later validate logs as it stands)."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set(trainer, 1)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._set(trainer, 0)

    @staticmethod
    def _set(trainer: pl.Trainer, offset: int) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, RunStepNumbering):
                logger.step_offset = offset
