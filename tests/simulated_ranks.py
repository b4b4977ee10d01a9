"""Lightning's real fit loop over W simulated ranks in one process, for the data position's properties.

What it stands in for: W processes under torchrun, each with its own DataModule, its own
loader (and loader workers) and its own copy of Lightning's loop counters. Here each simulated
rank is a real ``Phase2DataModule`` told its (world, rank), with its real ``train_dataloader``,
sampler, position count and resume; the W loaders are zipped by a ``CombinedLoader``, so one
micro-batch of the fit is one micro-batch on every rank, and Lightning's counters (which are
the same on every rank of a real job) are kept once. The model is one parameter; what the
gradient all-reduce would add is not simulated (the position and counters do not depend on it;
the end-to-end torchrun tests compare weights).

Checkpoints are the real CheckpointSaver's, at the end of the optimizer step in which its stop
request arrives, as a SIGTERM would be handled.
"""

from __future__ import annotations

import copy
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import Logger
from pytorch_lightning.utilities import CombinedLoader
from torch.utils.data import DataLoader

from purrsight.config import Config, dump_config, load_config
from purrsight.internals.lightning_loops import validate_at_optimizer_steps
from purrsight.observability.step_numbering import FitStepNumbering, RunStepNumbering
from purrsight.runs.checkpoint_files import newest_checkpoint
from purrsight.runs.checkpoint_saver import CheckpointSaver
from purrsight.runs.step_windows import StepWindows
from purrsight.training.datamodule import Phase2DataModule
from tests.helpers import DEFAULT_CONFIG
from tests.sample_ids import SampleIds, collate_ids


@dataclass(frozen=True)
class Shape:
    """One run's world and batch shape."""

    world: int
    batch: int
    accumulation: int
    workers: int

    def config(self, seed: int, val_every: int, grouped: bool = False, extra: tuple[str, ...] = ()) -> Config:
        # Grouped: groups of 6 samples sorted in windows of 3 groups, so 160 samples make many windows.
        grouping = ["data.group_by_length=true", "data.length_group_size=6", "data.length_group_window=3"] if grouped else []
        overrides = [
            *grouping,
            f"data.batch_size={self.batch}",
            f"data.num_workers={self.workers}",
            f"trainer.accumulate_grad_batches={self.accumulation}",
            f"trainer.val_every_n_steps={val_every}",
            f"run.seed={seed}",
            *extra,
        ]
        return load_config(DEFAULT_CONFIG, overrides, check_paths=False)


class RankView(Phase2DataModule):
    """One simulated rank's DataModule: the real one, with its world fixed and a set of sample ids."""

    def __init__(self, config: Config, size: int, world: int, rank: int) -> None:
        super().__init__(config)
        self.train_set = SampleIds(size)  # type: ignore[assignment]  # ids stand in for samples
        self.collator = collate_ids  # type: ignore[assignment]
        self._fixed_world = (world, rank)

    def _world(self) -> tuple[int, int]:
        return self._fixed_world

    def prepare_data(self) -> None:
        pass


class SimulatedJob(pl.LightningDataModule):
    def __init__(self, views: list[RankView], val_samples: int) -> None:
        super().__init__()
        self.views = views
        self.val_samples = val_samples

    def train_dataloader(self) -> CombinedLoader:
        for view in self.views:
            view.trainer = self.trainer
        return CombinedLoader({rank: view.train_dataloader() for rank, view in enumerate(self.views)}, "max_size_cycle")

    def val_dataloader(self) -> DataLoader[int]:
        return DataLoader(SampleIds(self.val_samples), batch_size=1, collate_fn=collate_ids)


@dataclass
class Record:
    micro_batches: list[tuple[int, int, dict[int, list[int]]]] = field(default_factory=list)  # (epoch, batch_idx, rank -> ids)
    windows: list[tuple[int, int, bool, bool]] = field(default_factory=list)  # (epoch, size, epoch's last, first of the fit)
    validated_at: list[tuple[int, bool]] = field(default_factory=list)  # (optimizer step, inside a window)
    validation_batches: list[tuple[int, int]] = field(default_factory=list)  # (optimizer step, batch index)
    logged: list[tuple[int, float]] = field(default_factory=list)  # (logger's step, the step the point belongs to)
    saved: list[tuple[int, int | None]] = field(default_factory=list)  # (checkpoint's step, the newest step logged then)
    late: list[tuple[int, float]] = field(default_factory=list)  # (logger's step, LateMetric's value: the step)
    gradient_errors: list[float] = field(default_factory=list)  # |applied gradient - mean over the window|
    positions_disagree: list[str] = field(default_factory=list)
    final_step: int = 0
    stopped: bool = False  # ended by its stop request (not by max_steps)
    resumed_in_epoch: int | None = None  # the epoch the resumed position named


class _Recorder(Logger):
    def __init__(self, record: Record) -> None:
        super().__init__()
        self.record = record

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if "belongs_to_step" in metrics and step is not None:
            self.record.logged.append((step, float(metrics["belongs_to_step"])))
        if "late_step" in metrics and step is not None:
            self.record.late.append((step, float(metrics["late_step"])))


class LateMetric(pl.Callback):
    """Logs the step in on_train_batch_end after the saver's hook, as Telemetry's perf/* are: at a
    checkpoint's step too it must reach the loggers, with its own step's value."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        pl_module.log("late_step", float(trainer.global_step), on_step=True, batch_size=1)


class RecordingLogger(RunStepNumbering, _Recorder):
    """Our loggers' step numbering (the real mixin) over a logger that records what it is handed."""


class OneWeight(pl.LightningModule):
    """Loss w * mean(ids) per micro-batch: its gradient is the batch's mean id, known exactly."""

    def __init__(
        self, job: SimulatedJob, record: Record, stop_at: int | None, legacy: str | None, stop_in_validation: bool = False
    ) -> None:
        super().__init__()
        layout, _, self.saved_when = (legacy or "").partition("+")  # e.g. "torchdata+mid-window"
        self.legacy = layout or None
        self.mid_window = self.legacy == "mid-window" or self.saved_when == "mid-window"
        self.weight = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        self.job = job
        self.record = record
        self.stop_at = stop_at  # micro-batch of this fit (1-based) at which a stop request arrives
        # ... or, with stop_in_validation, at the first validation pass from that micro-batch on
        self.stop_in_validation, self.stop_armed, self.stop_sent = stop_in_validation, False, False
        self.window_terms: list[float] = []
        self.micro_batches_here = 0
        self.windows_seen = 0

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        for view in self.job.views:
            view.count_trained_batch(self.current_epoch)
        self.micro_batches_here += 1
        if self.stop_at is not None and self.micro_batches_here == self.stop_at and not self.mid_window:
            if self.stop_in_validation:
                self.stop_armed = True
            else:
                saver(self.trainer).stop.request(signal.SIGTERM)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.mid_window and self.micro_batches_here == self.stop_at:  # the stop did not wait then
            saver(self.trainer).save(self.trainer)
            self.trainer.should_stop = True

    def training_step(self, batch: dict[int, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.record.micro_batches.append((self.current_epoch, batch_idx, {r: ids.tolist() for r, ids in batch.items()}))
        term = torch.cat(list(batch.values())).double().mean()
        self.window_terms.append(float(term))
        self.log("belongs_to_step", float(self.trainer.global_step + 1), on_step=True, batch_size=1)
        return self.weight.sum() * term

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        assert self.weight.grad is not None
        mean = sum(self.window_terms) / len(self.window_terms)
        self.record.gradient_errors.append(abs(float(self.weight.grad) - mean))
        loop = self.trainer.fit_loop.epoch_loop
        last = loop.batch_progress.current.ready == self.trainer.num_training_batches
        self.record.windows.append((self.current_epoch, len(self.window_terms), last, self.windows_seen == 0))
        self.window_terms = []
        self.windows_seen += 1

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.record.validation_batches.append((self.trainer.global_step, batch_idx))
        if batch_idx == 0:
            inside = self.trainer.fit_loop.epoch_loop._should_accumulate()
            self.record.validated_at.append((self.trainer.global_step, inside))
        if self.stop_armed and not self.stop_sent:  # as a SIGTERM arriving while the pass runs
            self.stop_sent = True
            saver(self.trainer).stop.request(signal.SIGTERM)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        logged_through = self.record.logged[-1][0] if self.record.logged else None
        self.record.saved.append((self.trainer.global_step, logged_through))
        positions = [view.position() for view in self.job.views]
        if any(p != positions[0] for p in positions):
            self.record.positions_disagree.append(repr(positions))
        config = dump_config(self.job.views[0].config)
        if self.legacy in (None, "mid-window"):
            checkpoint["purrsight"] = {"position": positions[0].as_dict(), "config": config}
        else:
            checkpoint["purrsight"] = {"config": config}
            write_legacy_position(checkpoint, self.legacy, self.job.views[0])

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Each rank reads its own copy of the file; the first view's copy is the one Lightning restores.
        as_saved = copy.deepcopy(checkpoint)
        for view in self.job.views:
            view.resume_from(checkpoint if view is self.job.views[0] else copy.deepcopy(as_saved))


LEGACY_LAYOUTS = ("torchdata", "no-loader-state", "sampler-state", "sampler-snapshot")
WORLDLESS_LAYOUTS = ("torchdata", "no-loader-state")  # kept no world size
# "mid-window": today's entry, but saved between a step's micro-batches, as a stop was before 2026-11-25.
# A layout may name when it was saved too: "<layout>+mid-window" (a stop, before 2026-11-25), or
# "<layout>+train-end" (the last step saved in on_train_end, where Lightning had already closed the
# epoch, as before feeade4 on 2026-11-23).


def save_the_last_step_at_train_end(saver: CheckpointSaver) -> None:
    """The saver as it was before feeade4: the last step's checkpoint written by on_train_end (the
    step count a multiple of every_n_steps was still saved at its batch end)."""
    at_batch_end = saver.on_train_batch_end

    def on_train_batch_end(trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        at_batch_end(trainer, pl_module, *args)
        step = trainer.global_step
        if step >= trainer.max_steps and step % saver.every_n_steps != 0 and not saver.stopped_by_signal:
            saver._save_due = False

    saver.on_train_batch_end = on_train_batch_end  # type: ignore[method-assign]


def write_legacy_position(checkpoint: dict[str, Any], layout: str, view: RankView) -> None:
    """Where an earlier PurrSight kept the data position, as its DataModule wrote it (git history:
    torchdata's StatefulDistributedSampler until 05cd6f7, then our sampler's state inside
    torchdata's StatefulDataLoader state until cd3cc88; before torchdata, no loader state)."""
    sampler = view.train_sampler
    assert sampler is not None
    epoch, trained = view._taken
    world, batch = view._world()[0], view.config.data.batch_size
    states = checkpoint["loops"]["fit_loop"]["state_dict"]
    if layout == "torchdata":  # rank 0's count in its own shard (torchdata's `yielded`), no world size
        states["combined_loader"] = [{"_sampler_iter_state": {"yielded": trained * batch}, "_num_yielded": trained}]
    elif layout == "sampler-state":  # 0 workers: the sampler's own count; an epoch's end is (epoch, its last sample)
        state = {"epoch": epoch, "consumed": sampler.start + trained * batch * world, "world_size": world}
        states["combined_loader"] = [{"_sampler_iter_state": {"sampler_state": state}}]
    elif layout == "sampler-snapshot":  # with workers: a snapshot taken ahead of training (here: the epoch's end)
        state = {"epoch": epoch, "consumed": sampler.size, "world_size": world}
        states["combined_loader"] = [{"_snapshot": {"_main_snapshot": {"_sampler_iter_state": {"sampler_state": state}}}}]
    else:
        assert layout == "no-loader-state", layout


def saver(trainer: pl.Trainer) -> CheckpointSaver:
    return next(c for c in trainer.callbacks if isinstance(c, CheckpointSaver))  # type: ignore[attr-defined]


def fit(
    shape: Shape,
    size: int,
    max_steps: int,
    folder: Path,
    seed: int = 0,
    stop_at: int | None = None,
    resume: bool = False,
    legacy: str | None = None,
    grouped: bool = False,
    overrides: tuple[str, ...] = (),
    stop_in_validation: bool = False,
) -> Record:
    """One fit of the simulated job; ``resume`` continues from the newest checkpoint in ``folder``;
    ``legacy`` writes the data position as an earlier version did (LEGACY_LAYOUTS); ``grouped``
    batches by length (data.group_by_length, the lengths SampleIds reports); ``overrides`` are more config settings;
    ``stop_in_validation``: the stop arrives in the first validation pass from micro-batch ``stop_at`` on."""
    val_every = 3
    config = shape.config(seed, val_every, grouped, overrides)
    views = [RankView(config, size, shape.world, rank) for rank in range(shape.world)]
    job = SimulatedJob(views, val_samples=2)
    record = Record()
    module = OneWeight(job, record, stop_at, legacy, stop_in_validation)
    checkpoints = folder / "checkpoints"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        max_epochs=-1,
        accumulate_grad_batches=shape.accumulation,
        val_check_interval=val_every * shape.accumulation,
        check_val_every_n_epoch=None,
        limit_val_batches=2,  # a pass of two batches: a stop in its first ends it there
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        logger=RecordingLogger(record),
        callbacks=[CheckpointSaver(checkpoints, every_n_steps=4, keep_last=2), FitStepNumbering(), StepWindows(), LateMetric()],
        default_root_dir=str(folder),
    )
    validate_at_optimizer_steps(trainer, val_every)
    if legacy is not None and legacy.endswith("+train-end"):
        save_the_last_step_at_train_end(saver(trainer))
    found = newest_checkpoint(checkpoints) if resume else None
    trainer.fit(module, datamodule=job, ckpt_path=str(found[0]) if found else None)
    record.final_step = trainer.global_step
    record.stopped = saver(trainer).stopped_by_signal is not None
    resumed = views[0]._resume_at
    record.resumed_in_epoch = resumed.epoch if resumed is not None else None
    return record
