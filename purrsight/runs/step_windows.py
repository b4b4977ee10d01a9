"""Each optimizer step is the mean over the micro-batches it took, and is the step the loggers log.

Lightning groups an epoch's micro-batches into windows of ``accumulate_grad_batches`` counted
from the epoch's start, steps at the epoch's last micro-batch whatever the window holds, and
divides every micro-batch's loss by ``accumulate_grad_batches``. Two windows are shorter:

- an epoch's last, when its micro-batch count is not a multiple of the accumulation;
- the first after a resume on another world size, batch or accumulation, which takes the
  micro-batches left to the new grouping's next boundary (runs/data_position.py).

Divided by the full count, such a window's gradient was smaller than the mean of what it took
(a step of 1 micro-batch out of 4 got a quarter of its weight). Here the accumulated gradient of
a window of ``n`` micro-batches is multiplied by ``accumulate_grad_batches / n`` before clipping
and the optimizer step, which makes it the mean over its ``n``, as an uninterrupted run with
that grouping computes. Whole windows are left untouched (bit for bit what Lightning computes).

The loggers take Lightning's ``_batches_that_stepped`` as the step; its restore leaves it one
behind the optimizer step when the first window after a resume is partial, so it is set from
the optimizer step at the fit's first micro-batch.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch

from purrsight.internals.lightning_loops import set_logged_step


class StepWindows(pl.Callback):
    def __init__(self) -> None:
        self.taken = 0  # micro-batches of the window in progress
        self.last_window = 0  # micro-batches the last optimizer step took
        self._started = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.taken, self._started = 0, False  # checkpoints are taken at step ends: no window is open

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._started:  # after Lightning's restore and its epoch loop's reset, which is where it goes wrong
            set_logged_step(trainer)
            self._started = True
        self.taken += 1

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.last_window, self.taken = self.taken, 0
        if 0 < self.last_window != trainer.accumulate_grad_batches:
            scale_gradients(optimizer, trainer.accumulate_grad_batches / self.last_window)


@torch.no_grad()
def scale_gradients(optimizer: torch.optim.Optimizer, factor: float) -> None:
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if parameter.grad is not None:
                parameter.grad.mul_(factor)  # a sharded (DTensor) gradient scales in place as well
