"""The DataModule: synthetic set on first use, the datasets (training.data_builder), stateful loaders."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from purrsight.config import Config
from purrsight.data.dataset import Collator, MultiModalDataset
from purrsight.data.synthetic import prepare_synthetic
from purrsight.training.data_builder import build_datasets


class Phase2DataModule(pl.LightningDataModule):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.prepare_data_per_node = True  # each node generates into its own (or the shared) folder
        self.train_set: MultiModalDataset | None = None
        self.val_set: MultiModalDataset | None = None
        self.collator: Collator | None = None

    def prepare_data(self) -> None:
        prepare_synthetic(self.config)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        world = self.trainer.world_size if self.trainer is not None else 1
        built = build_datasets(self.config, world)
        self.train_set, self.val_set, self.collator = built.train, built.val, built.collator

    def _loader(self, dataset: MultiModalDataset, shuffle: bool) -> StatefulDataLoader:
        data = self.config.data
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        # Our own distributed sampler (Lightning's injection is off): every rank sees a
        # disjoint shard, reshuffled per epoch (Lightning calls set_epoch), and drop_last
        # keeps all ranks at the same number of steps. The stateful variant skips the
        # already-seen samples lazily, in __iter__, after set_epoch: with a plain
        # DistributedSampler a resume past epoch 0 replayed epoch 0's order.
        sampler = StatefulDistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=self.config.run.seed, drop_last=shuffle
        )
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

    def train_dataloader(self) -> StatefulDataLoader:
        assert self.train_set is not None, "setup() runs before the loaders are built"
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> StatefulDataLoader | list[Any]:
        return self._loader(self.val_set, shuffle=False) if self.val_set is not None else []
