"""What each Ray Train worker runs: Ray's ranks, device and checkpoints mapped onto training.run.

Ray Train V2 starts the workers, the process group (backend and timeout from our config,
via TorchConfig) and restarts after failures; it sets RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, NODE_RANK and MASTER_ADDR/PORT as torchrun does. Here we add what our
parts read besides (GROUP_RANK for telemetry and the watchdog, the launch id for the run
folder), give Lightning Ray's ranks and device, relay a stop from the driver, and report
every checkpoint our CheckpointSaver writes to Ray, so that Ray's restore after a failure
and our own resume agree.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import ray
import ray.train
import ray.train.torch
import torch
from lightning_fabric.plugins.environments import ClusterEnvironment

from purrsight.cli import setup_logging, user_error_lines, user_errors
from purrsight.config import Config
from purrsight.training.checkpoints import CheckpointSaver
from purrsight.training.factory import build_strategy, resolve_accelerator
from purrsight.training.run import train

log = logging.getLogger("purrsight.ray_engine")
POINTER_FILE = "purrsight_checkpoint.json"  # what a checkpoint reported to Ray holds: where ours is
STOP_POLL_S = 1.0


class WorkerInputError(RuntimeError):
    """A bad input found by a worker; the driver prints it and exits 2 (the message is in the coordinator)."""


class RayTrainEnvironment(ClusterEnvironment):
    """Lightning's view of the ranks Ray Train assigned (the process group exists already)."""

    def __init__(self) -> None:
        self._context = ray.train.get_context()

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ["MASTER_ADDR"]

    @property
    def main_port(self) -> int:
        return int(os.environ["MASTER_PORT"])

    @staticmethod
    def detect() -> bool:
        return False  # chosen explicitly by the Ray engine, never guessed

    def world_size(self) -> int:
        return int(self._context.get_world_size())

    def set_world_size(self, size: int) -> None:
        pass  # Ray decided it

    def global_rank(self) -> int:
        return int(self._context.get_world_rank())

    def set_global_rank(self, rank: int) -> None:
        pass  # Ray decided it

    def local_rank(self) -> int:
        return int(self._context.get_local_rank())

    def node_rank(self) -> int:
        return int(self._context.get_node_rank())


class RelayedStop(pl.Callback):
    """Polls the coordinator for a stop the driver received and hands it to the CheckpointSaver."""

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator
        self._done = threading.Event()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        saver = next(c for c in trainer.callbacks if isinstance(c, CheckpointSaver))  # type: ignore[attr-defined]
        threading.Thread(target=self._poll, args=(saver,), name="purrsight-stop-relay", daemon=True).start()

    def _poll(self, saver: CheckpointSaver) -> None:
        while not self._done.wait(STOP_POLL_S):
            signum = ray.get(self.coordinator.stop_signal.remote())
            if signum is not None:
                saver.stop.request(signum)
                return

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._done.set()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._done.set()


class ReportCheckpointsToRay(pl.Callback):
    """After each save of our CheckpointSaver, every rank reports it to Ray (a barrier in Ray).

    Rank 0 reports a small folder naming our checkpoint file, not a copy of it: our file in
    the run folder stays the one source, and Ray keeps the newest ``keep_last`` names.
    """

    def __init__(self) -> None:
        self.reported_step = -1

    def _saver(self, trainer: pl.Trainer) -> CheckpointSaver:
        return next(c for c in trainer.callbacks if isinstance(c, CheckpointSaver))  # type: ignore[attr-defined]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.reported_step = trainer.global_step  # a resumed start is reported already

    def _report_new(self, trainer: pl.Trainer) -> None:
        saver = self._saver(trainer)
        if saver.last_saved_path is None or saver.last_saved_step == self.reported_step:
            return
        step = saver.last_saved_step
        metrics = {"step": step}
        name = f"step-{step:08d}"
        if trainer.is_global_zero:
            with tempfile.TemporaryDirectory(prefix="purrsight-ray-report-") as folder:
                pointer = {"path": str(saver.last_saved_path.resolve()), "step": step}
                (Path(folder) / POINTER_FILE).write_text(json.dumps(pointer))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder), checkpoint_dir_name=name)
        else:
            ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=name)
        self.reported_step = step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._report_new(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report_new(trainer)


def restored_checkpoint() -> str | None:
    """Our checkpoint file behind the newest checkpoint Ray restored after a failure, if any."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as folder:
        pointer = json.loads((Path(folder) / POINTER_FILE).read_text())
    path = Path(pointer["path"])
    if not path.is_file():
        log.warning("Ray restored %s (step %s), which is gone: resuming from the newest checkpoint", path, pointer["step"])
        return None
    return str(path)


def train_on_worker(settings: dict[str, Any]) -> dict[str, Any]:
    """The Ray Train worker function; ``settings`` come from the driver (driver.py)."""
    context = ray.train.get_context()
    os.environ["GROUP_RANK"] = str(context.get_node_rank())  # our node index (telemetry, watchdog)
    os.environ["PURRSIGHT_LAUNCH_ID"] = settings["launch"]
    os.environ["PURRSIGHT_NODE_ADDR"] = ray.util.get_node_ip_address()
    setup_logging(force=True)  # rank-prefixed lines like under torchrun, not Ray's format
    rank = context.get_world_rank()
    coordinator = settings["coordinator"]
    earlier_starts = ray.get(coordinator.worker_started.remote(rank))
    stopped_by_user_error = ray.get(coordinator.user_error.remote())
    if stopped_by_user_error:
        # Ray restarts the worker group after any failure; a bad input would fail again.
        log.warning("not training again: an earlier attempt stopped on: %s", stopped_by_user_error[0])
        return {}
    config = Config.model_validate(settings["config"])
    resume = restored_checkpoint() or (settings["resume"] if earlier_starts == 0 else None)
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    strategy = build_strategy(config, resolve_accelerator(config), RayTrainEnvironment(), device)
    callbacks: list[pl.Callback] = [RelayedStop(coordinator), ReportCheckpointsToRay()]
    try:
        outcome = train(config, resume, callbacks, generation=earlier_starts, strategy=strategy)
    except user_errors() as err:
        lines = user_error_lines(err)
        ray.get(coordinator.record_user_error.remote(lines))
        # Ray logs the traceback of whatever a worker raises: a short one for a user error.
        raise WorkerInputError(lines[0]) from None
    return {
        "final_step": outcome.final_step,
        "checkpoint": str(outcome.checkpoint) if outcome.checkpoint else None,
        "stopped_by_signal": outcome.stopped_by_signal,
    }
