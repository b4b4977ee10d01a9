"""Frozen image and audio encoders, from a local Hugging Face directory or a config dict.

A directory brings its own processor (AutoImageProcessor / AutoFeatureExtractor); a
config dict (the tiny default) builds a random-initialised model with a fixed seed,
so every rank and every restart builds the same frozen weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoFeatureExtractor,
    AutoImageProcessor,
    AutoModel,
    PretrainedConfig,
    SiglipVisionConfig,
    SiglipVisionModel,
    ViTConfig,
    ViTModel,
    Wav2Vec2Config,
    Wav2Vec2Model,
)

from purrsight.model.loading import ModelLoadError, architecture_digest

Modality = Literal["image", "audio"]
TINY_ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], type[nn.Module]]] = {
    "vit": (ViTConfig, ViTModel),
    "siglip": (SiglipVisionConfig, SiglipVisionModel),  # the vision tower of SigLIP, as the real config uses
    "wav2vec2": (Wav2Vec2Config, Wav2Vec2Model),
}


def _tower(model: nn.Module) -> nn.Module:
    """The part of a checkpoint that encodes one modality.

    CLIP/SigLIP checkpoints load as dual-tower models (take ``vision_model``); Whisper
    loads as an encoder-decoder (take its encoder). ViT, wav2vec2 and HuBERT are towers.
    """
    if hasattr(model, "vision_model"):
        return cast(nn.Module, model.vision_model)
    if getattr(model.config, "is_encoder_decoder", False) and hasattr(model, "get_encoder"):
        return cast(nn.Module, model.get_encoder())  # type: ignore[operator]  # a method, typed as a Module attribute
    return model


def _width(config: PretrainedConfig) -> int:
    config = getattr(config, "vision_config", None) or config
    for name in ("hidden_size", "d_model"):
        if isinstance(getattr(config, name, None), int):
            return int(getattr(config, name))
    raise ModelLoadError(f"cannot tell the output width of {type(config).__name__}")


class FrozenEncoder(nn.Module):
    """An encoder whose weights never train: no grads, always eval mode; its output is its token
    sequence (the projector decides how to reduce it, model/projector.py)."""

    def __init__(self, tower: nn.Module, input_name: str, width: int) -> None:
        super().__init__()
        self.tower = tower
        self.input_name = input_name
        self.width = width
        self.tower.requires_grad_(False)
        self.tower.eval()

    def train(self, mode: bool = True) -> FrozenEncoder:
        # Lightning calls model.train() before every epoch; a frozen encoder must keep
        # dropout and normalisation in inference behaviour regardless.
        super().train(mode)
        self.tower.eval()
        return self

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.tower(**{self.input_name: inputs}).last_hidden_state)


@dataclass
class LoadedEncoder:
    encoder: FrozenEncoder
    source: str  # a description for the frozen-source fingerprint


def load_encoder(
    modality: Modality, seed: int, *, path: str | None = None, config: dict[str, Any] | None = None, model_type: str | None = None
) -> LoadedEncoder:
    """From a local Hugging Face directory (``path``), or random-initialised from ``config``,
    a config dict of ``model_type`` (one of TINY_ARCHITECTURES)."""
    if path is not None:
        return _from_directory(Path(path), modality, load_processor(path, modality), seed)
    if config is None or model_type not in TINY_ARCHITECTURES:
        raise ModelLoadError(f"{modality} encoder: give a path, or a config with model_type in {', '.join(TINY_ARCHITECTURES)}")
    config_cls, model_cls = TINY_ARCHITECTURES[model_type]
    try:
        built = config_cls(**config)
    except (TypeError, ValueError) as err:
        raise ModelLoadError(f"{modality} encoder config ({model_type}): {err}") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(built)
    input_name = "pixel_values" if modality == "image" else "input_values"
    source = f"{model_type}-config:{architecture_digest(config)}:seed{seed}"
    return LoadedEncoder(FrozenEncoder(model, input_name, _width(built)), source)


def load_processor(directory: str | Path | None, modality: Modality) -> Any | None:
    """The directory's image processor or feature extractor; None for a config-dict encoder."""
    if directory is None:
        return None
    path = Path(directory)
    loader = AutoImageProcessor if modality == "image" else AutoFeatureExtractor
    try:
        return loader.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path}: cannot load the {modality} processor ({err})") from None


def _from_directory(path: Path, modality: Modality, processor: Any, seed: int) -> LoadedEncoder:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: not a Hugging Face model directory (no config.json)")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        # Weights the directory lacks (a pooler head, say) are initialised randomly on
        # load; a fixed seed makes them equal on every rank and every restart.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModel.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path}: cannot load the {modality} encoder ({err})") from None
    input_name = "pixel_values" if modality == "image" else processor.model_input_names[0]
    source = f"dir:{architecture_digest(config.to_dict())}"
    return LoadedEncoder(FrozenEncoder(_tower(model), input_name, _width(config)), source)
