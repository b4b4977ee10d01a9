"""The DataModule: synthetic set on first use, index scan, decoders, stateful loaders."""

from __future__ import annotations

import logging
from typing import Any

import pytorch_lightning as pl
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from purrsight.config import Config
from purrsight.data.dataset import Collator, MultiModalDataset, check_prompt_lengths
from purrsight.data.index import IndexFileError, scan_index
from purrsight.data.media import AudioDecoder, ImageDecoder
from purrsight.data.synthetic import generate
from purrsight.data.text import TextEncoder
from purrsight.model.encoders import load_processor
from purrsight.model.llm import load_tokenizer
from purrsight.model.multimodal import MODALITIES

log = logging.getLogger(__name__)


class Phase2DataModule(pl.LightningDataModule):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.prepare_data_per_node = True  # each node generates into its own (or the shared) folder
        self.train_set: MultiModalDataset | None = None
        self.val_set: MultiModalDataset | None = None
        self.collator: Collator | None = None

    def prepare_data(self) -> None:
        data = self.config.data
        if data.synthetic_dir is not None:
            s = data.synthetic
            generate(data.synthetic_dir, s.num_train, s.num_val, s.seed, s.image_size)

    def _decoders(self) -> tuple[ImageDecoder | None, AudioDecoder | None]:
        data = self.config.data
        # Absent key: modality disabled; None: the tiny default's fixed transform.
        processors = {
            modality: load_processor(getattr(self.config.model, f"{modality}_encoder"), modality)
            for modality in MODALITIES
            if getattr(self.config.model, f"{modality}_encoder").enabled
        }
        image = ImageDecoder(processors["image"], data.image_size) if "image" in processors else None
        audio = (
            AudioDecoder(processors["audio"], data.audio_sample_rate, data.audio_seconds, data.resample)
            if "audio" in processors
            else None
        )
        return image, audio

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        data = self.config.data
        tokenizer = load_tokenizer(self.config.tokenizer_dir())
        text = TextEncoder(tokenizer, data.max_length)
        image, audio = self._decoders()
        self.collator = Collator(
            tokenizer.pad_token_id,
            image.blank() if image else None,
            audio.blank() if audio else None,
        )
        train_index = scan_index(data.train_index)
        check_prompt_lengths(train_index, text.prompt_length, data.max_length)
        self.train_set = MultiModalDataset(train_index, text, image, audio, data.on_bad_sample)
        world = self.trainer.world_size if self.trainer is not None else 1
        if len(self.train_set) < data.batch_size * world:
            # drop_last would leave no batch at all: a run that "finishes" at step 0 is a silent no-op.
            raise IndexFileError(
                f"{data.train_index}: {len(self.train_set)} samples, fewer than one global batch "
                f"(data.batch_size {data.batch_size} x {world} processes); add samples or lower data.batch_size"
            )
        if data.val_index is not None:
            val_index = scan_index(data.val_index)
            check_prompt_lengths(val_index, text.prompt_length, data.max_length)
            self.val_set = MultiModalDataset(val_index, text, image, audio, data.on_bad_sample)
        log.info(
            "data: %d train samples (%s), %d val samples",
            len(self.train_set),
            data.train_index,
            len(self.val_set) if self.val_set else 0,
        )

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
