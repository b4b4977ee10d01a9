"""Export a checkpoint: LoRA merged into the LLM, written as a Hugging Face directory.

``OUT/`` holds ``config.json`` + ``model.safetensors`` + the tokenizer (loadable with plain
``AutoModelForCausalLM.from_pretrained(OUT)``), ``projectors.safetensors`` (the trained
projectors, keys ``<modality>.net.*``) and ``resolved_config.yaml`` (how to rebuild the
frozen encoders and the prefix layout).

The folder is published whole (purrsight/atomic_file.py): written into a hidden temporary folder
beside ``OUT``, checked, every file fsynced, then renamed to ``OUT``. An export killed half way
leaves no ``OUT`` (a loader never takes half an export for one), and the next export removes what
it left. An ``OUT`` that already holds files is refused, not written into or replaced.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer
from transformers.utils import logging as transformers_logging

from purrsight.atomic_file import publishing_folder, stale_temp_folders
from purrsight.config import Config, ConfigError, safe_yaml_load, write_resolved
from purrsight.errors import UserError
from purrsight.training.model_builder import build_model, fingerprint_v2
from purrsight.training.module import CHECKPOINT_META_KEY, CheckpointMismatchError, verify_checkpoint

MODEL_PREFIX = "model."
log = logging.getLogger(__name__)


def load_trained(checkpoint: Path) -> tuple[Config, torch.nn.Module, object]:
    """The model of a checkpoint, its trainable weights restored (frozen ones rebuilt)."""
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointMismatchError(f"{checkpoint}: checkpoint not found") from None
    meta = state.get(CHECKPOINT_META_KEY) if isinstance(state, dict) else None
    if not isinstance(meta, dict) or "config" not in meta:
        raise CheckpointMismatchError(f"{checkpoint}: not a PurrSight Phase 2 checkpoint")
    try:
        stored = safe_yaml_load(meta["config"])
        if isinstance(stored, dict) and isinstance(stored.get("model"), dict):
            # A config stored before model.projector existed built the pooled projector.
            stored["model"].setdefault("projector", meta.get("projector", "pooled"))
        config = Config.model_validate(stored)
    except ValueError as err:
        raise ConfigError([f"{checkpoint}: stored config is invalid: {err}"]) from None
    built = build_model(config)
    shapes = {MODEL_PREFIX + n: list(p.shape) for n, p in built.model.named_parameters() if p.requires_grad}
    # A checkpoint saved with version 2 is checked against version 2, computed for it (as a resume
    # does); version 3 was computed with the build.
    earlier = lambda version: fingerprint_v2(config) if version == 2 else built.earlier_fingerprints.get(version)  # noqa: E731
    verify_checkpoint(state, built.fingerprint, shapes, config.model.projector, earlier)
    trainable = {k[len(MODEL_PREFIX) :]: v for k, v in state["state_dict"].items()}
    unexpected = built.model.load_state_dict(trainable, strict=False).unexpected_keys
    if unexpected:
        raise CheckpointMismatchError(f"{checkpoint}: unexpected keys {unexpected[:3]}")
    built.model.eval()
    return config, built.model, built.tokenizer


def export(checkpoint: str | Path, out: str | Path) -> Path:
    out = Path(out)
    refuse_occupied(out)  # before the model is built: a second, not minutes
    config, model, tokenizer = load_trained(Path(checkpoint))
    merged = model.llm.merge_and_unload()  # type: ignore[union-attr,operator]
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_interrupted_exports(out)
    # A one-shard "Writing model shards" bar says nothing, and in a log file it is a line of \r.
    transformers_logging.disable_progress_bar()
    try:
        with publishing_folder(out) as folder:
            merged.save_pretrained(str(folder), safe_serialization=True)
            tokenizer.save_pretrained(str(folder))  # type: ignore[attr-defined]
            projectors = {k: v.contiguous() for k, v in model.projectors.state_dict().items()}  # type: ignore[union-attr]
            if projectors:
                save_file(projectors, str(folder / "projectors.safetensors"))
            write_resolved(config, folder)
            check_tokenizer_reloads(tokenizer, folder, shown_as=out)
    except OSError as err:
        if out.is_dir() and any(out.iterdir()):  # filled by someone else while this export ran: the rename failed
            raise ExportError(occupied(out)) from None
        raise ExportError(f"export to {out} failed: {err.strerror or err}; nothing was published there") from None
    return out


class ExportError(UserError):
    """The exported folder would not load as promised, or cannot be written; the message says why."""


def occupied(out: Path) -> str:
    return f"export: {out} already exists and holds files; choose another --out, or move it away (an export never writes into one)"


def refuse_occupied(out: Path) -> None:
    """ExportError when ``out`` is a file or a folder that holds files (an empty folder is taken)."""
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ExportError(occupied(out))


def remove_interrupted_exports(out: Path) -> None:
    """The hidden temporary folders that exports to ``out`` killed half way left beside it (each one's
    marker names ``out``: an export to ``model.v2`` is not one to ``model``)."""
    for stale in stale_temp_folders(out):
        log.warning("removing %s, left by an interrupted export", stale)
        shutil.rmtree(stale, ignore_errors=True)


PROBE_TEXTS = ("What colour is the cat in the picture?", " The sound is high.", "Digits 1234, and\nlines; Ünïcode too")


def check_tokenizer_reloads(trained: Any, out: Path, shown_as: Path | None = None) -> None:
    """The promise of the export: plain AutoTokenizer on the folder gives the trained ids.

    AutoTokenizer picks the class from config.json's model type (Qwen2Tokenizer for qwen2),
    not from the saved tokenizer: one of another family (the word-level tokenizer of older
    synthetic sets) came back from there turning a sentence into one token. ``shown_as``: the
    folder's name in the message (the export checks its temporary folder before publishing it).
    """
    reloaded = AutoTokenizer.from_pretrained(out, local_files_only=True)
    for text in PROBE_TEXTS:
        expected = trained(text, add_special_tokens=False)["input_ids"]
        got = reloaded(text, add_special_tokens=False)["input_ids"]
        if got != expected:
            raise ExportError(
                f"{shown_as or out}: AutoTokenizer.from_pretrained loads a {type(reloaded).__name__} that splits {text!r} into "
                f"{len(got)} tokens where the trained tokenizer made {len(expected)}; the tokenizer is not of the "
                "LLM's family (an older synthetic set? delete its folder so it is generated anew, and train again)"
            )
