"""The config's Phase 2 model on the meta device, from config files alone: shapes, no bytes.

The same classes training builds (the LLM through transformers' ``from_config`` with peft's LoRA,
the encoder towers, the aligner's shape, the projectors through ``PurrSightModel``), so every count
is the model's own. A model directory is read for its ``config.json`` only; the tokenizer only for
its size, where the LLM is a config dict without ``vocab_size``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig, Qwen2Config

from purrsight.config import Config
from purrsight.data.synthetic import TOKENIZER_VOCAB
from purrsight.errors import UserError
from purrsight.model.aligner import Phase1Aligner
from purrsight.model.encoders import TINY_ARCHITECTURES, FrozenEncoder, _tower, _width
from purrsight.model.llm import check_lora_targets, recompute_layers
from purrsight.model.multimodal import MODALITIES, PurrSightModel


@dataclass(frozen=True)
class MetaModel:
    model: PurrSightModel
    llm_config: PretrainedConfig  # the LLM's own (its text config for a multimodal one)
    encoder_inputs: dict[str, tuple[int, ...]]  # per modality, one sample's input shape


# An LLM's shape: a config.json without one of them would be priced at its class's defaults (a
# Qwen2Config's are a 7B's), a figure for some other model.
LLM_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def read_config_json(path: Path, key: str, required: tuple[str, ...] = ()) -> PretrainedConfig:
    """``path`` (a config.json, or a directory holding one) as its transformers config class; the
    ``required`` fields (by their name or the class's alias) must be written in it (or its text_config)."""
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"{key}: {path} holds no config.json (the estimate reads that file only; no weights)")
    try:
        values: dict[str, Any] = json.loads(file.read_text())
        hf = AutoConfig.for_model(values.pop("model_type"), **values)
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(f"{key}: {file} is not a Hugging Face config ({err})") from None
    text_values = values.get("text_config")
    written: dict[str, Any] = text_values if isinstance(text_values, dict) else values
    text = hf.get_text_config()
    aliases = type(text).attribute_map  # gpt2 writes hidden_size as n_embd
    # A field the class does not hold (gpt2's intermediate_size) it derives from the others.
    missing = [f for f in required if hasattr(text, f) and f not in written and aliases.get(f) not in written]
    if missing:
        raise UserError(f"{key}: {file} does not give the LLM's {', '.join(missing)} (the estimate needs its whole shape)")
    return hf  # type: ignore[no-any-return]


def _vocab_size(config: Config) -> int:
    """The tokenizer's size, as training gives a config-dict LLM; the synthetic set's before it exists."""
    folder = config.tokenizer_dir()
    if folder.is_dir():
        from purrsight.model.llm import load_tokenizer

        return len(load_tokenizer(folder))
    return TOKENIZER_VOCAB


def llm_config_of(config: Config, llm_config: Path | None) -> PretrainedConfig:
    if llm_config is not None:
        return read_config_json(llm_config, "--llm-config", LLM_SHAPE_FIELDS)
    llm = config.model.llm
    if llm.path is not None:
        return read_config_json(Path(llm.path), "model.llm.path", LLM_SHAPE_FIELDS)
    options = dict(llm.config or {})
    options.setdefault("vocab_size", _vocab_size(config))
    return Qwen2Config(**options)


def _lora(config: Config) -> LoraConfig:
    lora = config.model.llm.lora
    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft annotates int; a float alpha works
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def _encoder(config: Config, modality: str) -> tuple[FrozenEncoder, tuple[int, ...]]:
    cfg = getattr(config.model, f"{modality}_encoder")
    if cfg.path is not None:
        hf = read_config_json(Path(cfg.path), f"model.{modality}_encoder.path")
        tower = _tower(AutoModel.from_config(hf))
    elif cfg.config is not None and cfg.model_type in TINY_ARCHITECTURES:
        config_cls, model_cls = TINY_ARCHITECTURES[cfg.model_type]
        hf = config_cls(**cfg.config)
        tower = model_cls(hf)
    else:
        raise UserError(f"model.{modality}_encoder: give a path, or a config with model_type in {', '.join(TINY_ARCHITECTURES)}")
    vision = getattr(hf, "vision_config", None) or hf
    if modality == "image":
        side = int(getattr(vision, "image_size", config.data.image_size))
        return FrozenEncoder(tower, "pixel_values", _width(hf)), (3, side, side)
    if getattr(hf, "is_encoder_decoder", False):  # Whisper: log-mel features of its fixed 30 s window
        return FrozenEncoder(tower, "input_features", _width(hf)), (hf.num_mel_bins, 2 * hf.max_source_positions)
    samples = int(config.data.audio_sample_rate * config.data.audio_seconds)
    return FrozenEncoder(tower, "input_values", _width(hf)), (samples,)


def meta_model(config: Config, llm_config: Path | None = None) -> MetaModel:
    """``config``'s model with every parameter on the meta device (float32: counts, not dtypes).

    ``llm_config``: a config.json (or a directory holding one) whose shape replaces the LLM's, to
    price a base that is not on this machine (docs/SCALING.md's 32B and 72B rows).
    """
    hf_llm = llm_config_of(config, llm_config)
    llm_cfg = config.model.llm
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(hf_llm, attn_implementation=llm_cfg.attn_implementation, dtype=torch.float32)
        if llm_cfg.checkpointing:
            recompute_layers(base)
        base.config.use_cache = False
        check_lora_targets(base, list(llm_cfg.lora.target_modules))
        llm = get_peft_model(base, _lora(config))
        assert isinstance(llm, PeftModel)
        encoders, inputs = {}, {}
        for modality in MODALITIES:
            if getattr(config.model, f"{modality}_encoder").enabled:
                encoders[modality], inputs[modality] = _encoder(config, modality)
        aligner = None
        if config.model.aligner_checkpoint is not None:  # its shape only: the file is not read
            aligner = Phase1Aligner({name: enc.width for name, enc in encoders.items()}, config.model.aligner_dim)
        model = PurrSightModel(
            llm,
            encoders,
            aligner,
            config.model.prefix_tokens,
            config.model.projector_hidden,
            attention=llm_cfg.attn_implementation,
            projector=config.model.projector,
        )
    text_config = hf_llm.get_text_config() if hasattr(hf_llm, "get_text_config") else hf_llm
    return MetaModel(model, text_config, inputs)
