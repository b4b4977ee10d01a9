"""The DataModule: synthetic set on first use, the datasets (training.data_builder), the loaders,
and the training position (how far the job is in the epoch) that checkpoints keep."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import os
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from purrsight.config import Config
from purrsight.data.dataset import Collator, Sample, moved_batch, raw_conversations
from purrsight.data.formats.records import read_options
from purrsight.data.formats.sources import file_digest, sources_digest
from purrsight.data.loader_worker import init_loader_worker
from purrsight.data.prepared_manifest import MANIFEST_NAME
from purrsight.data.sampler import (
    GROUPING_VERSION,
    GlobalPositionSampler,
    batches_done,
    grouping_fit,
    grouping_window,
    sample_lengths,
)
from purrsight.datasets.builder import build_datasets
from purrsight.datasets.synthetic_set import ensure_synthetic_set
from purrsight.internals.lightning_loops import (
    drop_loader_states,
    epoch_batches_of,
    reopen_closed_epoch,
    saved_epoch_ended,
    set_batches_done,
)
from purrsight.runs.data_order import ORDER_KEY, DataChangedError, differences, only_the_grouping_version, order_of
from purrsight.runs.data_position import POSITION_KEY, DataPosition, InexactPositionError, saved_position

log = logging.getLogger(__name__)


# What the loader's fork server imports once, so each worker only unpickles its dataset (tokenizer,
# decoders); loader_fork_server leaves stop signals to the trainer (its docstring says why). No
# Lightning: tests/unit/test_loader_workers.py checks what this list imports.
LOADER_PRELOAD = (
    "purrsight.data.loader_fork_server",
    "purrsight.data.loader_worker",
    "purrsight.data.dataset",
    "purrsight.data.prepared",
    "transformers",
)


def _worker_start() -> multiprocessing.context.BaseContext:
    """Loader workers forked from a fork server that imported the data stack once (not this process)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(LOADER_PRELOAD))
    return context


def content_digest(config: Config) -> str:
    """The training set's content, as its source names it: the prepared manifest or the index."""
    data = config.data
    if data.prepared:
        return "prepared:" + file_digest(Path(data.prepared) / MANIFEST_NAME)
    return "index:" + sources_digest(data.train_index)


def _whole_steps(position: DataPosition, saved_ready: int) -> DataPosition:
    """The position at the last optimizer step's end when a checkpoint was saved inside a window.

    Lightning closes windows at multiples of the accumulation from the epoch's start (and at the
    epoch's end), so a saved count that is no multiple was taken between a step's micro-batches:
    versions before 2026-11-25 saved a stop there. Those micro-batches' gradients are in no file,
    so they are trained again, as the uninterrupted run trained them into their step.
    """
    partial = saved_ready % position.accumulation
    if partial == 0:
        return position
    log.warning(
        "checkpoint saved between the micro-batches of a step (an earlier PurrSight): its %d micro-batch(es) "
        "since the last step are trained again (their gradients were in no file)",
        partial,
    )
    return replace(position, consumed=position.consumed - partial * position.batch_size * position.world_size)


class Phase2DataModule(pl.LightningDataModule):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.prepare_data_per_node = True  # each node generates into its own (or the shared) folder
        self.train_set: Dataset[Sample] | None = None
        self.val_set: Dataset[Sample] | None = None
        self.collator: Collator | None = None
        self.train_sampler: GlobalPositionSampler | None = None
        self._lengths: np.ndarray | None = None  # the training samples' lengths, with data.group_by_length
        self._resume_at: DataPosition | None = None
        self._content: str | None = None  # the training set's content digest (runs/data_order.py), read once
        self.resume_note: str | None = None  # what a resume onto changed data did, for the attempt's record
        self._taken = (-1, 0)  # (epoch, its micro-batches this process trained)

    def prepare_data(self) -> None:
        ensure_synthetic_set(self.config)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        built = build_datasets(self.config, self._world()[0])
        self.train_set, self.val_set, self.collator = built.train, built.val, built.collator

    def _trainer_epoch(self) -> int:
        return self.trainer.current_epoch if self.trainer is not None else 0

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """The collator's batches moved directly (``moved_batch``), any other the generic way. Here, not
        in the LightningModule: Lightning takes a DataModule's override silently, and warns on every
        run when the module's would shadow the DataModule it was given."""
        moved = moved_batch(batch, device)
        return moved if moved is not None else super().transfer_batch_to_device(batch, device, dataloader_idx)

    def _loader(self, dataset: Dataset[Sample], sampler: Sampler[int], shuffle: bool) -> DataLoader[Sample]:
        data = self.config.data
        trainer = self.trainer
        on_gpu = trainer is not None and trainer.strategy.root_device.type == "cuda"
        pin = on_gpu if data.pin_memory == "auto" else bool(data.pin_memory)
        seed_workers = os.environ.get("PL_SEED_WORKERS") == "1"  # set by seed_everything(workers=True)
        # A plain loader: the training position is counted by the trainer (count_trained_batch),
        # not read from the loader, whose sampler runs ahead of training by the prefetched batches.
        return DataLoader(
            dataset,
            batch_size=data.micro_batch,
            sampler=sampler,
            collate_fn=self.collator,
            num_workers=data.num_workers,
            pin_memory=pin,
            persistent_workers=data.num_workers > 0,
            # Workers start from a fork server, not by forking this process: by the time the loader
            # starts them the trainer runs threads (gloo's, the watchdog's, the progress publisher's),
            # and a fork while one of them holds an interpreter lock leaves the worker hung for ever
            # (seen: Python 3.11's PyOS_AfterFork_Child waiting on the thread-state lock).
            multiprocessing_context=_worker_start() if data.num_workers > 0 else None,
            worker_init_fn=partial(init_loader_worker, rank=self._world()[1], seed_workers=seed_workers, trainer=os.getpid()),
            drop_last=shuffle,
            generator=torch.Generator().manual_seed(self.config.run.seed),
        )

    def train_dataloader(self) -> DataLoader[Sample]:
        assert self.train_set is not None, "setup() runs before the loaders are built"
        # Our own distributed samplers (Lightning's injection is off): every rank sees a
        # disjoint shard, reshuffled per epoch (Lightning calls set_epoch), and every rank
        # takes the same number of steps. Training keeps the job's global position in the
        # epoch (data/sampler.py), so a resume continues exactly, on any world size.
        world, rank = self._world()
        data = self.config.data
        lengths = None
        if data.group_by_length:
            if self._lengths is None:  # read once per run: every rank alike, from the same set
                self._lengths = sample_lengths(self.train_set)
                problem = grouping_fit(data.length_group_size, data.micro_batch, world)
                if problem and rank == 0:
                    log.warning(problem)
            lengths = self._lengths
        self.train_sampler = GlobalPositionSampler(
            len(self.train_set),  # type: ignore[arg-type]
            world,
            rank,
            self.config.run.seed,
            lengths,
            data.length_group_size,
            data.length_group_window,
        )
        at = self._resume_at
        if at is not None:
            self.train_sampler.resume_at(at.epoch, at.consumed, at.world_size)
        # Lightning creates the loader's iterator before it advances its epoch (on a resume from
        # an epoch's last step, to the next), and loader workers draw their first indices at once:
        # the sampler starts in the epoch the position names, not in the trainer's epoch of now.
        self.train_sampler.set_epoch(at.epoch if at is not None else self._trainer_epoch())
        return self._loader(self.train_set, self.train_sampler, shuffle=True)

    # ------------------------------------------------------------------ training position

    def count_trained_batch(self, epoch: int) -> None:
        """Called as each training micro-batch starts (it is trained before any save can follow)."""
        counted_epoch, count = self._taken
        self._taken = (epoch, count + 1 if counted_epoch == epoch else 1)

    def position(self) -> DataPosition:
        """Where the job stands in its data now, for a checkpoint."""
        world, _ = self._world()
        data, trainer_cfg = self.config.data, self.config.trainer
        epoch, trained = self._taken
        sampler = self.train_sampler
        if sampler is None or trained == 0:  # nothing trained by this process yet: where it started
            at = self._resume_at
            return at if at is not None else DataPosition(0, 0, world, data.micro_batch, trainer_cfg.accumulate_grad_batches)
        if trained >= sampler.pass_samples // data.micro_batch:  # the epoch is over: the next starts at its beginning
            epoch, consumed = epoch + 1, 0
        else:
            consumed = sampler.start + trained * data.micro_batch * world
        return DataPosition(epoch, consumed, world, data.micro_batch, trainer_cfg.accumulate_grad_batches)

    def data_order(self) -> dict[str, Any]:
        """What decides the training order now, for a checkpoint (runs/data_order.py)."""
        assert self.train_set is not None, "setup() runs before a checkpoint is saved or loaded"
        if self._content is None:
            self._content = content_digest(self.config)
        return order_of(self.config, len(self.train_set), self._content, GROUPING_VERSION)  # type: ignore[arg-type]

    def _order_checked(self, checkpoint: dict[str, Any], position: DataPosition) -> DataPosition:
        """``position``, or where the next epoch starts when the data changed and the user asked for that."""
        meta = checkpoint.get("purrsight")
        saved = meta.get(ORDER_KEY) if isinstance(meta, dict) else None
        if not isinstance(saved, dict):
            log.info("the checkpoint predates the data-order record (2026-11-27): its training set is not compared")
            return position
        now = self.data_order()
        changed = differences(saved, now)
        if not changed:
            return position
        if only_the_grouping_version(saved, now) and self._grouped_as_in_version_1():
            log.info("resume: the checkpoint's length grouping is version 1, and this set's order is the same in version 2")
            return position
        what = "; ".join(changed)
        if self.config.data.on_data_change == "refuse":
            raise DataChangedError(
                f"resume: the training order changed since the checkpoint ({what}): its position (epoch {position.epoch}, "
                f"sample {position.consumed}) would count in another order. Resume with the data and settings it had, or set "
                "data.on_data_change=next_epoch to start the next epoch at sample 0 on the data as it is"
            )
        epoch = position.epoch + (1 if position.consumed else 0)
        self.resume_note = f"data changed ({what}): epoch {epoch} from sample 0"
        log.warning("resume: the training order changed since the checkpoint (%s): epoch %d starts at sample 0", what, epoch)
        return replace(position, epoch=epoch, consumed=0)

    def _grouped_as_in_version_1(self) -> bool:
        """Whether the grouping's version 2 orders this training set as version 1 did: a window of
        the configured size (the set is at least two of them) and lengths counted alike (no raw
        conversation, whose length was its JSON's)."""
        data = self.config.data
        size = len(self.train_set)  # type: ignore[arg-type]
        whole = grouping_window(size, data.length_group_size, data.length_group_window)
        conversations = raw_conversations(self.train_set, data.format, read_options(data).fields)
        return whole == data.length_group_size * data.length_group_window and not conversations

    def resume_from(self, checkpoint: dict[str, Any]) -> None:
        """Take the data position a checkpoint holds, and count its epoch's done batches in this run's units.

        Lightning restores its in-epoch batch count as saved and ends the epoch when the count
        reaches len(loader); saved on another world size or batch size, that count is in the
        other run's batches. It is derived again from the position, in this run's batches.
        Called from the LightningModule's on_load_checkpoint, before Lightning restores its loops.
        """
        world, _ = self._world()
        if self.train_set is None:
            return
        size, batch = len(self.train_set), self.config.data.micro_batch  # type: ignore[arg-type]
        has_position = isinstance(checkpoint.get("purrsight"), dict) and POSITION_KEY in checkpoint["purrsight"]
        if not has_position and reopen_closed_epoch(checkpoint):  # only versions before our position entry
            log.info(
                "resume: the checkpoint's last step was saved after its epoch closed (before 2026-11-23): epoch %d continues",
                checkpoint["epoch"],
            )
        try:
            position = saved_position(checkpoint, world, size)
        except InexactPositionError as err:
            if self.config.data.on_data_change == "refuse":
                raise
            position = DataPosition(err.epoch + 1, 0, world, batch, self.config.trainer.accumulate_grad_batches)
            self.resume_note = f"position not exact ({err}): epoch {position.epoch} from sample 0"
            log.warning("resume: %s; data.on_data_change=next_epoch: epoch %d starts at sample 0", err, position.epoch)
        drop_loader_states(checkpoint)
        if position is None:
            return
        epoch_batches = (size // world) // batch
        if position.epoch == int(checkpoint.get("epoch", 0)) and saved_epoch_ended(checkpoint):
            # Saved at its epoch's last batch by a version that kept the epoch's end as (epoch, its
            # last sample): Lightning's restore moves on to the next epoch, and so does the position.
            position = replace(position, epoch=position.epoch + 1, consumed=0)
        elif position.epoch == int(checkpoint.get("epoch", 0)):
            position = _whole_steps(position, epoch_batches_of(checkpoint))
        position = self._order_checked(checkpoint, position)
        self._resume_at = position
        # Saved as its epoch ended, or the next epoch asked for: Lightning's restore moves on. Else
        # exact, not rounded to whole steps: Lightning finds the epoch's last batch by this count (a
        # rounded one missed it, and the epoch's last micro-batches joined the next epoch's first
        # step). Checkpoints are taken at step ends, so on the same world size the count is whole
        # steps; after a change of world size the first step takes the micro-batches left to the new
        # world's next step boundary (runs/step_windows.py makes that step the mean of what it took).
        ended = position.epoch > int(checkpoint.get("epoch", 0))
        done = epoch_batches if ended else batches_done(size, world, batch, position.consumed)
        set_batches_done(checkpoint, done, epoch_ended=ended)

    def val_dataloader(self) -> DataLoader[Sample] | list[Any]:
        if self.val_set is None:
            return []
        # Starts over each time; pads the last shard so every rank validates as many batches.
        world, rank = self._world()
        return self._loader(self.val_set, DistributedSampler(self.val_set, world, rank, shuffle=False), shuffle=False)
