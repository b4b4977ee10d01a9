"""When and how checkpoints are written: every N steps, at the end, and at an agreed stop.

Layout in ``<run_dir>/checkpoints``: ``step-00000050.ckpt`` ... (the newest
``keep_last``), and ``last.ckpt``, a hard link to the newest (a copy where the
filesystem has no hard links). Every file, ``last.ckpt``'s link or copy included, goes
through purrsight/atomic_file.py (a unique temporary name, fsync, rename), so a process
killed mid-write leaves the previous checkpoint whole, and the ``.*.tmp`` file it left is
removed at the next start.
"""

from __future__ import annotations

import logging
import shutil
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

from purrsight.atomic_file import publish, stale_temp_files
from purrsight.distributed.stop_vote import StopRequest, StopVote
from purrsight.errors import UserError
from purrsight.internals.lightning_loops import end_validation_now, log_step_then, skip_empty_batch_hooks, take_over_a_noted_sigterm
from purrsight.run_folder import LAST_NAME, link_or_copy, step_checkpoints, step_name

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save published whole or not at all (purrsight/atomic_file.py: temp file, fsync, rename)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        target = Path(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            publish(target, lambda stream: torch.save(checkpoint, stream))
        except (OSError, RuntimeError) as err:
            # torch.save's zip writer reports a full disk as RuntimeError ("unexpected pos").
            reason = getattr(err, "strerror", None) or (
                "No space left on device" if shutil.disk_usage(target.parent).free < 4 * 2**20 else str(err)
            )
            raise CheckpointWriteError(
                f"cannot write checkpoint {target}: {reason}; the checkpoints already in {target.parent} are intact"
            ) from None

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        # Checkpoints hold tensors, numbers, strings and the loops' plain dicts: no pickled
        # objects, so the safe unpickler is enough, and a malicious file is refused.
        # Memory-mapped: every rank loads the file, and an eager load put all of it in each
        # rank's memory (8 x 12 GB a node for the pooled projector's state at the 7B preset).
        # Mapped, a node's ranks share its pages in the page cache and each reads what it
        # takes: under fsdp its shard (rank 0 scatters the rest), under ddp the whole state.
        return torch.load(path, map_location=map_location or "cpu", weights_only=True, mmap=True)


def validation_cut_by_stop(trainer: pl.Trainer) -> bool:
    """Whether the validation pass in progress (or just ended) was cut short by an agreed stop.

    During a fit only our stop sets ``should_stop`` (no callback of Lightning's that sets it is
    used), so it names the cut pass, whose metrics cover part of the set.
    """
    return bool(trainer.should_stop) and trainer.state.fn == "fit"


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (disk full, quota, permissions); earlier ones are intact."""


class CheckpointSaver(pl.Callback):
    """Saves every N optimizer steps, at the end, and when a stop signal arrives.

    Two halves at a step's end. This callback, first in the trainer's list, takes the stop vote and
    decides whether the step is saved (the later callbacks see ``should_stop``). The save itself
    runs in ``SaveAtStepEnd``, which ``setup`` puts last: Lightning hands a step's metrics to the
    loggers after every ``on_train_batch_end`` hook, so the save hands them over first, every
    callback's included (lightning_loops.log_step_then), then writes. A checkpoint is on disk only
    after its step's metrics are with the loggers and the tracker queue: a SIGKILL between the two
    left a step that the resume, starting after it, never logged.
    """

    def __init__(self, folder: Path, every_n_steps: int, keep_last: int, collective_timeout: timedelta | None = None) -> None:
        self.folder = folder
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.last_saved_step = -1
        self.last_saved_path: Path | None = None
        self.stop = StopRequest()
        self.vote = StopVote(collective_timeout)
        self.stopped_by_signal: int | None = None
        self._stop_agreed = False
        self._step_before = -1  # the optimizer step count at the previous micro-batch's end
        self._save_due = False  # decided in on_train_batch_end, written by SaveAtStepEnd
        self.at_step_end = SaveAtStepEnd(self)
        self.after_save: list[Callable[[pl.Trainer], None]] = []  # called on every rank after each save
        self.seconds_saving = 0.0  # wall time in saves, barrier included (the attempt ledger reports it)

    def save(self, trainer: pl.Trainer) -> Path:
        started = time.monotonic()
        step = trainer.global_step
        path = self.folder / step_name(step)
        # Every rank calls; rank 0 writes, then all meet at a barrier. A failed write (disk
        # full) stops the run with CheckpointWriteError: going on would train hours that no
        # checkpoint holds. The previous checkpoints are left as they were.
        trainer.save_checkpoint(path, weights_only=False)  # optimizer and loops too: a full resume
        if trainer.is_global_zero:
            link_or_copy(path, self.folder / LAST_NAME)
            # Oldest first; the file just written is never among those removed, whatever
            # else lies in the folder.
            for _, old in step_checkpoints(self.folder)[: -self.keep_last]:
                if old != path:
                    old.unlink(missing_ok=True)
            log.info("checkpoint saved: %s (step %d)", path, step)
        self.last_saved_step, self.last_saved_path = step, path
        self.seconds_saving += time.monotonic() - started
        for listener in self.after_save:
            listener(trainer)
        return path

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.at_step_end not in trainer.callbacks:  # type: ignore[attr-defined]
            trainer.callbacks.append(self.at_step_end)  # type: ignore[attr-defined]  # last: after every other hook
            skip_empty_batch_hooks([self.at_step_end])  # as the trainer's builder did for the others

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self.folder.is_dir():
            for stale in stale_temp_files(self.folder):  # a write that was killed half way
                log.warning("removing %s, left by an interrupted checkpoint write", stale)
                stale.unlink(missing_ok=True)
        # Installed here, after Lightning registered its own SIGTERM handler (which
        # abandons the run without a checkpoint), so ours wins for the whole fit.
        self.stop.install()
        if take_over_a_noted_sigterm(trainer):  # arrived while Lightning's handler was the one
            self.stop.request(signal.SIGTERM)
        self.vote.setup()
        self.last_saved_step = trainer.global_step  # a resumed run's start is already saved
        self._step_before, self._stop_agreed = trainer.global_step, False

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        self._stop_agreed |= self.vote.exchange(self.stop.signum is not None)  # every micro-batch: a collective
        stepped, self._step_before = step != self._step_before, step
        self._save_due = False  # decided anew at every micro-batch, whatever an earlier fit left
        if not stepped:
            # Mid-accumulation: a checkpoint here would count the micro-batches taken so far as
            # trained while their gradients are in no file; a stop waits for the step's end (at
            # most accumulate_grad_batches - 1 micro-batches, the same on every rank).
            return
        stop = self._stop_agreed
        # The last step is saved here too, not in on_train_end: by then Lightning has closed the
        # epoch in its loop state, and a resume from that file (RESUME=auto with a larger
        # trainer.max_steps) started the next epoch, leaving the rest of this one out.
        last = trainer.max_steps > 0 and step >= trainer.max_steps
        due = step % self.every_n_steps == 0 or last
        self._save_due = (stop or due) and step != self.last_saved_step  # written by SaveAtStepEnd
        if stop:
            self.stopped_by_signal = self.stop.signum or signal.SIGTERM
            trainer.should_stop = True

    def save_due(self, trainer: pl.Trainer) -> None:
        """SaveAtStepEnd: write the checkpoint decided at this step's end, its metrics logged first."""
        if self._save_due:
            self._save_due = False
            log_step_then(trainer, lambda: self.save(trainer))

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        """A stop during a validation pass ends the pass: it could take minutes at real size, past a
        preemption's grace period. Validation runs right after an optimizer step, so the position
        is at a step's end and the stop checkpoint is written when the pass ends (on_validation_end).
        Every rank validates as many batches (the sampler pads), so the vote stays in step."""
        if trainer.state.fn != "fit":
            return
        self._stop_agreed |= self.vote.exchange(self.stop.signum is not None)
        if self._stop_agreed and not trainer.should_stop:
            trainer.should_stop = True  # also tells the module and the progress lines that this pass was cut
            if trainer.is_global_zero:
                log.warning("stop while validating step %d: the pass ends here, its metrics are not logged", trainer.global_step)
            end_validation_now()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not (validation_cut_by_stop(trainer) and self._stop_agreed):
            return
        if trainer.global_step != self.last_saved_step:
            self.save(trainer)
        self.stopped_by_signal = self.stop.signum or signal.SIGTERM

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.vote.finish()  # no collective left in flight behind the final save
        if trainer.global_step != self.last_saved_step:
            self.save(trainer)
        self.stop.restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.stop.restore()


class SaveAtStepEnd(pl.Callback):
    """The saver's second half, last among the trainer's callbacks (CheckpointSaver.setup puts it
    there): every other callback has logged this step's metrics when it saves."""

    def __init__(self, saver: CheckpointSaver) -> None:
        self.saver = saver

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.saver.save_due(trainer)
