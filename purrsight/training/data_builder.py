"""The training and validation sets and their collator, as a config describes them.

Free of Lightning: the DataModule wraps these, and bench/plain_ddp.py trains on the very
same samples with a plain PyTorch loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from purrsight.config import Config
from purrsight.data.dataset import Collator, MultiModalDataset, check_prompt_lengths
from purrsight.data.index import IndexFileError, scan_index
from purrsight.data.media import AudioDecoder, ImageDecoder
from purrsight.data.text import TextEncoder
from purrsight.model.encoders import load_processor
from purrsight.model.llm import load_tokenizer
from purrsight.model.multimodal import MODALITIES

log = logging.getLogger(__name__)


@dataclass
class Datasets:
    train: MultiModalDataset
    val: MultiModalDataset | None
    collator: Collator


def build_decoders(config: Config) -> tuple[ImageDecoder | None, AudioDecoder | None]:
    data = config.data
    # Absent key: modality disabled; None: the tiny default's fixed transform.
    processors = {
        modality: load_processor(getattr(config.model, f"{modality}_encoder").path, modality)  # type: ignore[arg-type]
        for modality in MODALITIES
        if getattr(config.model, f"{modality}_encoder").enabled
    }
    image = (
        ImageDecoder(processors["image"], data.image_size, data.max_image_pixels, data.image_background)
        if "image" in processors
        else None
    )
    audio = (
        AudioDecoder(processors["audio"], data.audio_sample_rate, data.audio_seconds, data.resample)
        if "audio" in processors
        else None
    )
    return image, audio


def build_datasets(config: Config, world_size: int) -> Datasets:
    """Scan the indexes and check every prompt fits, before any step; errors name the file."""
    data = config.data
    tokenizer = load_tokenizer(config.tokenizer_dir())
    text = TextEncoder(tokenizer, data.max_length)
    image, audio = build_decoders(config)
    collator = Collator(tokenizer.pad_token_id, image.blank() if image else None, audio.blank() if audio else None)
    train_index = scan_index(data.train_index)
    check_prompt_lengths(train_index, text.prompt_length, data.max_length)
    train = MultiModalDataset(train_index, text, image, audio, data.on_bad_sample, data.max_consecutive_bad_samples)
    if len(train) < data.batch_size * world_size:
        # drop_last would leave no batch at all: a run that "finishes" at step 0 is a silent no-op.
        raise IndexFileError(
            f"{data.train_index}: {len(train)} samples, fewer than one global batch "
            f"(data.batch_size {data.batch_size} x {world_size} processes); add samples or lower data.batch_size"
        )
    val = None
    if data.val_index is not None:
        val_index = scan_index(data.val_index)
        check_prompt_lengths(val_index, text.prompt_length, data.max_length)
        val = MultiModalDataset(val_index, text, image, audio, data.on_bad_sample, data.max_consecutive_bad_samples)
    log.info("data: %d train samples (%s), %d val samples", len(train), data.train_index, len(val) if val else 0)
    return Datasets(train, val, collator)
