"""The real-size Phase 2 model as config dicts, and its training FLOPs per sample.

config/qwen2.5-0.5b.yaml points at local model directories; the benchmarks cannot fetch
them, so they build the same architectures randomly initialised from these dicts (the
published configs of Qwen2.5-0.5B-Instruct, siglip-base-patch16-224's vision tower and
wav2vec2-base). Compute and memory do not depend on the weights' values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from bench.common import REPO
from purrsight.data.synthetic import generate
from purrsight.observability.flops import flops_per_token

REAL_CONFIG = REPO / "config" / "qwen2.5-0.5b.yaml"

QWEN2_5_0_5B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
SIGLIP_BASE_224: dict[str, Any] = {
    "image_size": 224,
    "patch_size": 16,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
}
WAV2VEC2_BASE: dict[str, Any] = {}  # transformers' Wav2Vec2Config defaults are wav2vec2-base


def synthetic_tokenizer(folder: Path) -> Path:
    """A tokenizer directory made offline (the synthetic set's); Qwen's own cannot be fetched here."""
    generate(folder, 8, 2, 0, 32)  # a tiny set: only its tokenizer is used
    return folder / "tokenizer"


def random_init_overrides(tokenizer_dir: Path) -> list[str]:
    """Overrides turning config/qwen2.5-0.5b.yaml's model directories into config dicts."""

    def flow(mapping: dict[str, Any]) -> str:
        return "{" + ", ".join(f"{k}: {v}" for k, v in mapping.items()) + "}"

    return [
        "model.llm.path=null",
        f"model.llm.config={flow(QWEN2_5_0_5B)}",
        f"model.llm.tokenizer={tokenizer_dir}",
        "model.image_encoder.path=null",
        "model.image_encoder.model_type=siglip",
        f"model.image_encoder.config={flow(SIGLIP_BASE_224)}",
        "model.audio_encoder.path=null",
        "model.audio_encoder.model_type=wav2vec2",
        f"model.audio_encoder.config={flow(WAV2VEC2_BASE)}",
    ]


def encoder_forward_flops(image_size: int = 224, audio_samples: int = 16000) -> dict[str, float]:
    """Forward FLOPs of the frozen towers for one sample, counted on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import SiglipVisionConfig, SiglipVisionModel, Wav2Vec2Config, Wav2Vec2Model

    with torch.device("meta"):
        image_tower = SiglipVisionModel(SiglipVisionConfig(**SIGLIP_BASE_224))
        audio_tower = Wav2Vec2Model(Wav2Vec2Config(**WAV2VEC2_BASE))
        pixels = torch.empty(1, 3, image_size, image_size)
        wave = torch.empty(1, audio_samples)
    flops = {}
    for name, tower, inputs in (("image", image_tower, {"pixel_values": pixels}), ("audio", audio_tower, {"input_values": wave})):
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            tower(**inputs)
        flops[name] = float(counter.get_total_flops())
    return flops


def llm_counts(lora_r: int, target_modules: list[str]) -> tuple[int, int]:
    """(LLM parameters, LoRA parameters) of Qwen2.5-0.5B, counted on the meta device."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN2_5_0_5B))
    base = sum(p.numel() for p in model.parameters())
    lora = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in target_modules:
            lora += lora_r * (module.in_features + module.out_features)
    return base + lora, lora


def training_flops_per_sample(seq_len: int, prefix_tokens: int, lora_r: int, target_modules: list[str], audio_s: float) -> float:
    """Model FLOPs of one training sample: LLM (telemetry's count, per processed token) plus the towers' forward."""
    llm_params, lora = llm_counts(lora_r, target_modules)
    tokens = seq_len + prefix_tokens
    per_token = flops_per_token(llm_params, lora, QWEN2_5_0_5B["num_hidden_layers"], QWEN2_5_0_5B["hidden_size"], tokens)
    towers = encoder_forward_flops(audio_samples=round(16000 * audio_s))
    return per_token * tokens + towers["image"] + towers["audio"]
