"""torch.profiler for a window of optimizer steps, one Chrome trace per rank.

``profiler.enabled: true`` records steps ``start_step`` .. ``end_step`` into
``<run>/profiler/rank<R>.json``; open it in chrome://tracing or https://ui.perfetto.dev.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger(__name__)


class StepProfiler(pl.Callback):
    def __init__(self, folder: Path, start_step: int, end_step: int) -> None:
        self.folder = folder
        self.start_step = start_step
        self.end_step = end_step
        self._profile: profile | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._profile is None and trainer.global_step == self.start_step:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._profile = profile(activities=activities, record_shapes=True, with_stack=False)
            self._profile.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._profile is not None and trainer.global_step >= self.end_step:
            self._finish(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._profile is not None:
            self._finish(trainer)

    def _finish(self, trainer: pl.Trainer) -> None:
        assert self._profile is not None
        self._profile.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rank{trainer.global_rank}.json"
        self._profile.export_chrome_trace(str(path))
        self._profile = None
        log.info("profiler trace of steps %d..%d: %s", self.start_step, self.end_step, path)
