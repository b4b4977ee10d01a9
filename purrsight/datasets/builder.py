"""The training and validation sets and their collator, as a config describes them.

Free of Lightning: the DataModule wraps these, and bench/launch/plain_ddp.py trains on the very
same samples with a plain PyTorch loop.

Checked once per job: rank 0 reads the indexes (or verifies the prepared set) and every
other rank takes its result through the process group, so no rank but one touches every
media file, tokenises every prompt or hashes the index before training.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from purrsight.config import Config
from purrsight.data.dataset import Collator, MultiModalDataset, Sample, check_prompt_lengths
from purrsight.data.formats.records import ReadOptions
from purrsight.data.formats.records import read_options as options_of
from purrsight.data.formats.sources import sources_digest
from purrsight.data.index import MAX_LISTED_PROBLEMS, IndexFileError, RecordTable, SampleIndex, read_index
from purrsight.data.media import AudioDecoder, ImageDecoder
from purrsight.data.prepared import PreparedSplit
from purrsight.data.prepared_manifest import (
    FORMAT_VERSION,
    PreparedSetError,
    check_sources,
    differences,
    read_manifest,
    tokenizer_digest,
)
from purrsight.data.text import TextEncoder
from purrsight.model.encoders import load_processor
from purrsight.model.llm import load_tokenizer
from purrsight.model.loading import ModelLoadError, architecture_digest
from purrsight.model.multimodal import MODALITIES

log = logging.getLogger(__name__)


@dataclass
class Datasets:
    train: Dataset[Sample]
    val: Dataset[Sample] | None
    collator: Collator


def read_options(config: Config) -> ReadOptions:
    """How the formats' readers find a sample's parts (data.fields, data.caption_prompt, data.media_root)."""
    return options_of(config.data)


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


# --------------------------------------------------------------------------- prepared sets


def _tower_digest(config: Config, modality: str) -> str:
    """The tower's architecture (not its folder's location): a prepared set is made for one tower."""
    encoder = getattr(config.model, f"{modality}_encoder")
    if encoder.config is not None:
        return architecture_digest({**encoder.config, "model_type": encoder.model_type})
    config_file = Path(encoder.path) / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(
            f"model.{modality}_encoder.path: {encoder.path} has no config.json "
            "(a Hugging Face model directory holds config.json, the weights and the processor)"
        )
    return architecture_digest(json.loads(config_file.read_text()))


def _processor_digest(processor: Any | None) -> str | None:
    return None if processor is None else architecture_digest(processor.to_dict())


def preparation_settings(config: Config, image: ImageDecoder | None, audio: AudioDecoder | None) -> dict[str, Any]:
    """Everything a prepared sample depends on besides the index: a set made with other values is stale."""
    data = config.data
    settings: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "tokenizer": tokenizer_digest(config.tokenizer_dir()),
        "max_length": data.max_length,
        "caption_prompt": data.caption_prompt,
        "fields": data.fields.model_dump(),
        "image": None,
        "audio": None,
    }
    if image is not None:
        settings["image"] = {
            "tower": _tower_digest(config, "image"),
            "processor": _processor_digest(image.processor),
            "image_size": data.image_size if image.processor is None else None,
            "max_image_pixels": data.max_image_pixels,
            "background": list(data.image_background),
            "storage": image.storage,
        }
    if audio is not None:
        settings["audio"] = {
            "tower": _tower_digest(config, "audio"),
            "sample_rate": data.audio_sample_rate,
            "seconds": data.audio_seconds,
            "resample": data.resample,
        }
    return settings


def source_of(index: str, fmt: str, records: int) -> dict[str, Any]:
    """What a split was prepared from: the index's content (its path may differ on another machine)."""
    return {"index": index, "format": fmt, "sha256": sources_digest(index), "records": records}


def verify_prepared(config: Config, folder: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The manifest of ``folder`` when it was made from these indexes with these settings; else one line why not."""
    manifest = read_manifest(folder)
    changed = differences(manifest.get("settings"), settings)
    if changed:
        raise PreparedSetError(
            f"data.prepared: {folder} was made with other settings ({', '.join(changed)} differ from this config); "
            "prepare it again into another folder (--out) or delete it"
        )
    check_sources(manifest, folder, {"train": config.data.train_index, "val": config.data.val_index}, config.overridden)
    return manifest


# --------------------------------------------------------------------------- checked once, shared


def _shared(check: Callable[[], Any]) -> Any:
    """``check()`` on rank 0; its result (or its user error, raised) on every rank."""
    import torch.distributed as dist

    from purrsight.distributed.process_group import from_rank_zero

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    result: Any = None
    problem: IndexFileError | PreparedSetError | None = None
    if not distributed or dist.get_rank() == 0:
        try:
            result = check()
        except (IndexFileError, PreparedSetError) as err:
            problem = err
    if distributed:
        result, lines = from_rank_zero((result, problem.lines() if problem is not None else None))
        if lines and problem is None:
            raise IndexFileError(problems=lines)  # the same lines on every rank: all exit 2 together
    if problem is not None:
        raise problem
    return result


def scanned_index(index: str, text: TextEncoder, max_length: int, config: Config | None = None) -> list[dict[str, Any]]:
    """Every line validated, media files present, every prompt fits: on rank 0 only."""
    fmt, options = (config.data.format, read_options(config)) if config is not None else ("auto", None)
    records = read_index(index, fmt=fmt, options=options, max_problems=MAX_LISTED_PROBLEMS)
    refuse_bad = config is not None and config.data.on_bad_sample == "error"
    check_prompt_lengths(index, records, text.prompt_length, max_length, text.first_prompt_length, refuse_bad)
    return records


def build_datasets(config: Config, world_size: int) -> Datasets:
    """The sets of a run, checked before any step; errors name the file and line."""
    data = config.data
    tokenizer = load_tokenizer(config.tokenizer_dir())
    text = TextEncoder(tokenizer, data.max_length)
    image, audio = build_decoders(config)
    collator = Collator(
        tokenizer.pad_token_id,
        image.blank() if image else None,
        audio.blank() if audio else None,
        pad_to=data.pad_to_multiple_of,
        max_length=data.max_length,
    )

    def raw(index: str) -> MultiModalDataset:
        records = _shared(lambda: scanned_index(index, text, data.max_length, config))
        sample_index = SampleIndex(path=Path(index), records=RecordTable(records))
        return MultiModalDataset(sample_index, text, image, audio, data.on_bad_sample, data.max_consecutive_bad_samples)

    train: Dataset[Sample]
    val: Dataset[Sample] | None = None
    if data.prepared is not None:
        folder = Path(data.prepared)
        manifest = _shared(lambda: verify_prepared(config, folder, preparation_settings(config, image, audio)))
        train = PreparedSplit(folder, manifest["splits"]["train"]["shards"], image, audio)
        if data.val_index is not None and "val" in manifest["splits"]:
            val = PreparedSplit(folder, manifest["splits"]["val"]["shards"], image, audio)
        elif data.val_index is not None:
            val = raw(data.val_index)  # a validation set may stay raw: it is small
        source = f"prepared {folder}"
    else:
        train = raw(data.train_index)
        val = raw(data.val_index) if data.val_index is not None else None
        source = data.train_index
    if len(train) < data.micro_batch * world_size:  # type: ignore[arg-type]
        # drop_last would leave no batch at all: a run that "finishes" at step 0 is a silent no-op.
        raise IndexFileError(
            f"{source}: {len(train)} samples, fewer than one global batch "  # type: ignore[arg-type]
            f"(data.batch_size {data.micro_batch} x {world_size} processes); add samples or lower data.batch_size"
        )
    log.info("data: %d train samples (%s), %d val samples", len(train), source, len(val) if val else 0)  # type: ignore[arg-type]
    return Datasets(train, val, collator)
