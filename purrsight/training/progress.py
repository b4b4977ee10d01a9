"""Progress for log files: one line every N optimizer steps on rank 0.

Lightning's bar redraws with carriage returns, which turns a log file into one huge
line; in a file (or under torchrun's redirects) a plain line per interval reads better.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import pytorch_lightning as pl

log = logging.getLogger("purrsight.progress")


def use_progress_bar(mode: str) -> bool:
    return mode == "bar" or (mode == "auto" and sys.stderr.isatty())


def _format(metrics: dict[str, Any], prefix: str) -> str:
    parts = []
    for key, value in sorted(metrics.items()):
        if key.startswith(prefix):
            parts.append(f"{key} {float(value):.4g}")
    return "  ".join(parts)


class LineProgress(pl.Callback):
    def __init__(self, every_n_steps: int) -> None:
        self.every_n_steps = every_n_steps
        self._start = 0.0
        self._last_logged = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.monotonic()
        self._first_step = trainer.global_step
        if trainer.is_global_zero:
            log.info("training from step %d to %d", trainer.global_step, trainer.max_steps)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if not trainer.is_global_zero or step == self._last_logged or step % self.every_n_steps:
            return
        self._last_logged = step
        elapsed = time.monotonic() - self._start
        rate = (step - self._first_step) / elapsed if elapsed > 0 else 0.0
        log.info("step %d/%d  %s  %.2f steps/s", step, trainer.max_steps, _format(trainer.callback_metrics, "train/"), rate)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            log.info("validation at step %d  %s", trainer.global_step, _format(trainer.callback_metrics, "val/"))
