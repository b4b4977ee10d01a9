"""What rank 0 shows while training: a bar on a terminal, a line every N steps in a log file.

Training is counted in optimizer steps to ``trainer.max_steps``; epochs only repeat the
shuffled data (``max_epochs=-1``), so Lightning's own bar, which counts batches per epoch
and shows ``Epoch 1/-2``, measures the wrong thing. Both views log the same validation and
checkpoint lines; on a terminal those lines are written above the bar, never into it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, TextIO

import pytorch_lightning as pl
from pytorch_lightning.callbacks.progress.progress_bar import ProgressBar
from tqdm import tqdm

from purrsight.runs.checkpoint_saver import validation_cut_by_stop

log = logging.getLogger("purrsight.progress")

# metric -> its name in the bar (the log lines keep the full names)
BAR_NAMES = {"train/loss": "loss", "val/loss": "val_loss", "val/accuracy": "val_acc"}


def use_progress_bar(mode: str) -> bool:
    return mode == "bar" or (mode == "auto" and sys.stderr.isatty())


def _format(metrics: dict[str, Any], prefix: str) -> str:
    parts = []
    for key, value in sorted(metrics.items()):
        if key.startswith(prefix):
            parts.append(f"{key} {float(value):.4g}")
    return "  ".join(parts)


def _log_start(trainer: pl.Trainer) -> None:
    if trainer.is_global_zero:
        log.info("training from step %d to %d", trainer.global_step, trainer.max_steps)


def _log_validation(trainer: pl.Trainer) -> None:
    if trainer.is_global_zero and not trainer.sanity_checking and not validation_cut_by_stop(trainer):
        log.info("validation at step %d  %s", trainer.global_step, _format(trainer.callback_metrics, "val/"))


class StepLines(pl.Callback):
    """For log files: one line every ``every_n_steps`` optimizer steps on rank 0."""

    def __init__(self, every_n_steps: int) -> None:
        self.every_n_steps = every_n_steps
        self._start = 0.0
        self._first_step = 0
        self._last_logged = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.monotonic()
        self._first_step = trainer.global_step
        _log_start(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step % self.every_n_steps or step == self._last_logged or not trainer.is_global_zero:
            return  # the cheap tests first: the rank is a chain of properties down to the environment
        self._last_logged = step
        elapsed = time.monotonic() - self._start
        rate = (step - self._first_step) / elapsed if elapsed > 0 else 0.0
        log.info("step %d/%d  %s  %.2f steps/s", step, trainer.max_steps, _format(trainer.callback_metrics, "train/"), rate)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _log_validation(trainer)


class _AboveBar:
    """A stream for logging handlers: each record is written above the bar, which then redraws."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        tqdm.write(text, file=self.stream, end="")

    def flush(self) -> None:
        self.stream.flush()


@contextmanager
def _logs_above_bar() -> Iterator[None]:
    """Point the terminal's log handlers at the bar's writer while it is shown."""
    swapped: list[tuple[logging.StreamHandler[Any], TextIO]] = []
    for handler in logging.getLogger().handlers:
        if type(handler) is logging.StreamHandler and handler.stream in (sys.stderr, sys.stdout):
            swapped.append((handler, handler.setStream(_AboveBar(handler.stream))))  # type: ignore[arg-type]
    try:
        yield
    finally:
        for handler, stream in swapped:
            handler.setStream(stream)


class StepBar(ProgressBar):
    """For terminals: one bar over optimizer steps, with the newest loss and validation result.

    The numbers beside the bar change on logging steps only: reading a metric on the others
    would make the host wait for the GPU each step, for a loss logged steps ago.
    """

    def __init__(self, every_n_steps: int = 1) -> None:
        super().__init__()
        self.every_n_steps = every_n_steps
        self._enabled = True
        self._bar: tqdm[Any] | None = None
        self._redirect = ExitStack()

    def enable(self) -> None:
        self._enabled = True

    def disable(self) -> None:
        self._enabled = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _log_start(trainer)
        if not (self._enabled and trainer.is_global_zero):
            return
        self._redirect.enter_context(_logs_above_bar())
        self._bar = tqdm(
            total=trainer.max_steps,
            initial=trainer.global_step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            file=sys.stderr,
        )

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._bar is None or trainer.global_step == self._bar.n:
            return  # a micro-batch of an accumulated step: nothing moved
        self._bar.update(trainer.global_step - self._bar.n)
        if trainer.global_step % self.every_n_steps == 0:
            self._show_metrics(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._bar is not None and not trainer.sanity_checking:
            self._bar.set_description("validating")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _log_validation(trainer)
        if self._bar is not None and not trainer.sanity_checking:
            self._bar.set_description("train")
            self._show_metrics(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    def _show_metrics(self, trainer: pl.Trainer) -> None:
        assert self._bar is not None
        metrics = trainer.callback_metrics
        shown = {short: f"{float(metrics[name]):.4g}" for name, short in BAR_NAMES.items() if name in metrics}
        self._bar.set_postfix(shown, refresh=True)

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._redirect.close()
