"""Lightning's side of a Ray Train worker: Ray's ranks, a relayed stop, checkpoints reported to Ray.

Imported by the worker function after it has logged its start, so that the start-up time
spent importing Lightning is counted as ours, not Ray's (bench/launch/ray_vs_torchrun.py).
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import ray
import ray.train
from lightning_fabric.plugins.environments import ClusterEnvironment

from purrsight.ray_engine.pointer import prune_stale, write_pointer
from purrsight.runs.checkpoint_saver import CheckpointSaver

STOP_POLL_S = 1.0


def checkpoint_saver(trainer: pl.Trainer) -> CheckpointSaver:
    """The run's CheckpointSaver among the trainer's callbacks (training.run puts it first)."""
    return next(c for c in trainer.callbacks if isinstance(c, CheckpointSaver))  # type: ignore[attr-defined]


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
        saver = checkpoint_saver(trainer)
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
    the run folder stays the one source, and Ray keeps the newest ``keep_last`` names. Then
    it prunes earlier jobs' reports whose file our rotation deleted (pointer.prune_stale).
    """

    def __init__(self, ray_root: Path, job: str) -> None:
        self.ray_root = ray_root  # RunConfig.storage_path: <run folder>/ray, a folder per job
        self.job = job
        self.reported_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.reported_step = trainer.global_step  # a resumed start is reported already
        saver = checkpoint_saver(trainer)
        if self._report_new not in saver.after_save:
            saver.after_save.append(self._report_new)  # right after each save, wherever it happens

    def _report_new(self, trainer: pl.Trainer) -> None:
        saver = checkpoint_saver(trainer)
        if saver.last_saved_path is None or saver.last_saved_step == self.reported_step:
            return
        step = saver.last_saved_step
        metrics = {"step": step}
        name = f"step-{step:08d}"
        if trainer.is_global_zero:
            with tempfile.TemporaryDirectory(prefix="purrsight-ray-report-") as folder:
                write_pointer(Path(folder), saver.last_saved_path, step)
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder), checkpoint_dir_name=name)
            prune_stale(self.ray_root, self.job)
        else:
            ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=name)
        self.reported_step = step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report_new(trainer)
