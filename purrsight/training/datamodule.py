"""The DataModule: synthetic set on first use, the datasets (training.data_builder), stateful loaders."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from purrsight.config import Config
from purrsight.data.dataset import Collator, Sample
from purrsight.data.sampler import GlobalPositionSampler, batches_done, resumed_position
from purrsight.training.checkpoint_files import sampler_state_in
from purrsight.training.data_builder import build_datasets
from purrsight.training.synthetic_data import prepare_synthetic


class Phase2DataModule(pl.LightningDataModule):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.prepare_data_per_node = True  # each node generates into its own (or the shared) folder
        self.train_set: Dataset[Sample] | None = None
        self.val_set: Dataset[Sample] | None = None
        self.collator: Collator | None = None

    def prepare_data(self) -> None:
        prepare_synthetic(self.config)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        world = self.trainer.world_size if self.trainer is not None else 1
        built = build_datasets(self.config, world)
        self.train_set, self.val_set, self.collator = built.train, built.val, built.collator

    def _loader(self, dataset: Dataset[Sample], shuffle: bool) -> StatefulDataLoader:
        data = self.config.data
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        # Our own distributed samplers (Lightning's injection is off): every rank sees a
        # disjoint shard, reshuffled per epoch (Lightning calls set_epoch), and every rank
        # takes the same number of steps. Training keeps the job's global position in the
        # epoch (data/sampler.py), so a resume continues exactly, on any world size;
        # validation starts over each time and pads the last shard like DistributedSampler.
        sampler: Sampler[int]
        if shuffle:
            sampler = GlobalPositionSampler(len(dataset), world, rank, self.config.run.seed)  # type: ignore[arg-type]
        else:
            sampler = StatefulDistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
        on_gpu = trainer is not None and trainer.strategy.root_device.type == "cuda"
        pin = on_gpu if data.pin_memory == "auto" else bool(data.pin_memory)
        return StatefulDataLoader(
            dataset,
            batch_size=data.batch_size,
            sampler=sampler,
            collate_fn=self.collator,
            num_workers=data.num_workers,
            pin_memory=pin,
            persistent_workers=data.num_workers > 0,
            drop_last=shuffle,
            generator=torch.Generator().manual_seed(self.config.run.seed),
        )

    def align_epoch_progress(self, checkpoint: dict[str, Any]) -> None:
        """Count the resumed epoch's done batches in this world's units, in the checkpoint's loop state.

        Lightning restores its in-epoch batch count as saved and ends the epoch when the count
        reaches len(loader). Saved on another world size, that count is in the other world's
        batches: the epoch would end early (samples left out) or run past the sampler. Called from
        the LightningModule's on_load_checkpoint, before Lightning restores its loops.
        """
        state = sampler_state_in(checkpoint)
        trainer = self.trainer
        if state is None or self.train_set is None or trainer is None:
            return
        consumed, _ = resumed_position(state, trainer.world_size)
        done = batches_done(len(self.train_set), trainer.world_size, self.config.data.batch_size, consumed)  # type: ignore[arg-type]
        progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
        shift = done - progress["ready"]
        for counter in ("ready", "started", "processed", "completed"):  # their offsets to each other are kept
            progress[counter] += shift

    def train_dataloader(self) -> StatefulDataLoader:
        assert self.train_set is not None, "setup() runs before the loaders are built"
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> StatefulDataLoader | list[Any]:
        return self._loader(self.val_set, shuffle=False) if self.val_set is not None else []
