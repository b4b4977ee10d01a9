"""Export a checkpoint: LoRA merged into the LLM, written as a Hugging Face directory.

``OUT/`` holds ``config.json`` + ``model.safetensors`` + the tokenizer (loadable with plain
``AutoModelForCausalLM.from_pretrained(OUT)``), ``projectors.safetensors`` (the trained
projectors, keys ``<modality>.net.*``) and ``resolved_config.yaml`` (how to rebuild the
frozen encoders and the prefix layout).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from purrsight.config import Config, ConfigError, safe_yaml_load, write_resolved
from purrsight.training.build import build_model
from purrsight.training.module import CHECKPOINT_META_KEY, CheckpointMismatchError, verify_checkpoint

MODEL_PREFIX = "model."


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
        config = Config.model_validate(safe_yaml_load(meta["config"]))
    except ValueError as err:
        raise ConfigError([f"{checkpoint}: stored config is invalid: {err}"]) from None
    built = build_model(config)
    shapes = {MODEL_PREFIX + n: list(p.shape) for n, p in built.model.named_parameters() if p.requires_grad}
    verify_checkpoint(state, built.fingerprint, shapes)
    trainable = {k[len(MODEL_PREFIX) :]: v for k, v in state["state_dict"].items()}
    unexpected = built.model.load_state_dict(trainable, strict=False).unexpected_keys
    if unexpected:
        raise CheckpointMismatchError(f"{checkpoint}: unexpected keys {unexpected[:3]}")
    built.model.eval()
    return config, built.model, built.tokenizer


def export(checkpoint: str | Path, out: str | Path) -> Path:
    out = Path(out)
    config, model, tokenizer = load_trained(Path(checkpoint))
    merged = model.llm.merge_and_unload()  # type: ignore[union-attr,operator]
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))  # type: ignore[attr-defined]
    projectors = {k: v.contiguous() for k, v in model.projectors.state_dict().items()}  # type: ignore[union-attr]
    if projectors:
        save_file(projectors, str(out / "projectors.safetensors"))
    write_resolved(config, out)
    return out
