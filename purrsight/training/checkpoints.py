"""When and how checkpoints are written, and which one a run resumes from.

Layout in ``<run_dir>/checkpoints``: ``step-00000050.ckpt`` ... (the newest
``keep_last``), and ``last.ckpt``, a hard link to the newest (a copy where the
filesystem has no hard links). Every file is written to a temporary name, flushed
and renamed, so a process killed mid-write leaves the previous checkpoint whole.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO

from purrsight.errors import UserError
from purrsight.training.run_folder import LAST_NAME, link_or_copy, step_checkpoints, step_name

log = logging.getLogger(__name__)


FAULT_ENV = "PURRSIGHT_FAULT"  # fault injection for the reliability tests (docs/RELIABILITY.md)


def inject_fault_during_write(stream: Any) -> None:
    """PURRSIGHT_FAULT=kill_during_checkpoint_write:N: SIGKILL this process during the N-th write.

    The temp file is half written and flushed when the kill lands, as when a node dies or
    the OOM killer strikes mid-save. Off unless the variable is set.
    """
    spec = os.environ.get(FAULT_ENV, "")
    first_generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")
    if not spec.startswith("kill_during_checkpoint_write:") or not first_generation:
        return  # restarted workers must be able to finish, or the fault would repeat forever
    global _writes_seen
    _writes_seen += 1
    if _writes_seen == int(spec.split(":", 1)[1]):
        stream.flush()
        os.kill(os.getpid(), signal.SIGKILL)


_writes_seen = 0


class AtomicCheckpointIO(TorchCheckpointIO):
    """torch.save to a temp file in the target folder, fsync, then rename over the target."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            handle, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        except OSError as err:
            raise CheckpointWriteError(f"cannot create a checkpoint in {target.parent}: {err.strerror}") from None
        try:
            with os.fdopen(handle, "wb") as stream:
                torch.save(checkpoint, stream)
                inject_fault_during_write(stream)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(tmp_name, target)
        except (OSError, RuntimeError) as err:
            # torch.save's zip writer reports a full disk as RuntimeError ("unexpected pos").
            Path(tmp_name).unlink(missing_ok=True)
            reason = getattr(err, "strerror", None) or (
                "No space left on device" if shutil.disk_usage(target.parent).free < 4 * 2**20 else str(err)
            )
            raise CheckpointWriteError(
                f"cannot write checkpoint {target}: {reason}; the checkpoints already in {target.parent} are intact"
            ) from None
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        # Checkpoints hold tensors, numbers, strings and the loops' plain dicts: no pickled
        # objects, so the safe unpickler is enough, and a malicious file is refused.
        return torch.load(path, map_location=map_location or "cpu", weights_only=True)


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (disk full, quota, permissions); earlier ones are intact."""


class StopRequest:
    """Records SIGTERM/SIGINT instead of dying mid-step; the saver acts on it at step end."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            # Signal handlers live in the main thread only. An engine that runs training in
            # another thread (Ray Train) relays stops through request() instead.
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.request(signum)

    def request(self, signum: int) -> None:
        """Stop as if ``signum`` had arrived (safe from any thread)."""
        if self.signum is None:
            log.warning("received %s: finishing this step, then saving a checkpoint", signal.Signals(signum).name)
        self.signum = signum


class StopVote:
    """Whether any rank received a stop signal, agreed by all ranks one step late.

    Each step starts an all-reduce (MAX) of this rank's flag without waiting for it and
    reads the previous step's result, which has long arrived: every rank calls the same
    collectives in the same order and reaches the same decision at the same step. A
    blocking vote each step cost about 3% of a small model's step time (a second
    synchronisation point besides DDP's gradient all-reduce, bench/README.md).
    """

    def __init__(self) -> None:
        self._pending: tuple[Any, torch.Tensor] | None = None

    def exchange(self, local_stop: bool, device: torch.device) -> bool:
        """Start this step's vote; return the previous step's outcome (False at the first)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return local_stop
        previous = self.finish()
        flag = torch.tensor([int(local_stop)], device=device)
        work = torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, async_op=True)
        self._pending = (work, flag)
        return previous

    def finish(self) -> bool:
        """Wait for the vote in flight, if any; its outcome."""
        if self._pending is None:
            return False
        work, flag = self._pending
        self._pending = None
        work.wait()
        return bool(flag.item())


class CheckpointSaver(pl.Callback):
    """Saves every N optimizer steps, at the end, and when a stop signal arrives."""

    def __init__(self, folder: Path, every_n_steps: int, keep_last: int) -> None:
        self.folder = folder
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.last_saved_step = -1
        self.last_saved_path: Path | None = None
        self.stop = StopRequest()
        self.vote = StopVote()
        self.stopped_by_signal: int | None = None

    def save(self, trainer: pl.Trainer) -> Path:
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
        return path

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self.folder.is_dir():
            for stale in self.folder.glob(".*.tmp"):  # a write that was killed half way
                log.warning("removing %s, left by an interrupted checkpoint write", stale)
                stale.unlink(missing_ok=True)
        # Installed here, after Lightning registered its own SIGTERM handler (which
        # abandons the run without a checkpoint), so ours wins for the whole fit.
        self.stop.install()
        self.last_saved_step = trainer.global_step  # a resumed run's start is already saved

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        stop = self.vote.exchange(self.stop.signum is not None, trainer.strategy.root_device)
        due = step != self.last_saved_step and step % self.every_n_steps == 0
        if (stop or due) and step != self.last_saved_step:
            self.save(trainer)
        if stop:
            self.stopped_by_signal = self.stop.signum or signal.SIGTERM
            trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.vote.finish()  # no collective left in flight behind the final save
        if trainer.global_step != self.last_saved_step:
            self.save(trainer)
        self.stop.restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.stop.restore()
