"""The projectors (model/projector.py): what the tokens projector keeps of the encoder's tokens, its
size at the 7B preset, and the pooled projector of earlier runs computing what it computed."""

from __future__ import annotations

from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM

from purrsight.config import load_config
from purrsight.model.projector import Projector, TokenProjector, build_projector, pooled_tokens
from tests.helpers import REPO

# Qwen2.5-7B-Instruct's shape (its config.json), siglip-base-patch16-224's and wav2vec2-base's width.
QWEN25_7B: dict[str, Any] = dict(
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    vocab_size=152064, tie_word_embeddings=False,
)  # fmt: skip
TOWER_WIDTH = 768


def test_a_picture_is_pooled_over_its_patch_grid_and_keeps_where_things_are() -> None:
    grid = torch.zeros(1, 14 * 14, 2)
    grid[0, 0, 0] = 1.0  # a mark in the top-left patch
    grid[0, 14 * 14 - 1, 1] = 1.0  # another in the bottom-right one
    pooled = pooled_tokens(grid, 32, "grid")  # 14x14 -> 4x8, raster order
    assert pooled.shape == (1, 32, 2)
    assert pooled[0, :, 0].nonzero().flatten().tolist() == [0]
    assert pooled[0, :, 1].nonzero().flatten().tolist() == [31]
    with_class_token = torch.cat([torch.full((1, 1, 2), 100.0), grid], dim=1)  # ViT: [CLS] + patches
    assert torch.equal(pooled_tokens(with_class_token, 32, "grid"), pooled)


def test_a_recording_is_pooled_over_time_even_when_its_frame_count_is_a_square() -> None:
    frames = torch.arange(256.0).view(1, 256, 1)  # 256 = 16 x 16 frames: still a sequence
    pooled = pooled_tokens(frames, 4, "sequence")
    assert pooled.flatten().tolist() == [31.5, 95.5, 159.5, 223.5]  # the mean of each quarter, in time order
    assert pooled_tokens(torch.ones(1, 3, 1), 8, "sequence").shape == (1, 8, 1)  # fewer frames than tokens


def test_the_pooled_projector_of_earlier_runs_computes_what_it_computed() -> None:
    """Its weights, from a checkpoint of before, on the mean of the tokens: the old forward."""
    torch.manual_seed(0)
    projector = Projector(16, 32, 8, 4)
    tokens = torch.randn(3, 10, 16)
    old = projector.net(tokens.mean(dim=1)).view(3, 4, 8)  # what the earlier model computed
    assert torch.equal(projector(projector.reduce(tokens)), old)


def trainable_at_the_7b_preset(kind: str) -> int:
    """Projectors and LoRA of config/qwen2.5-7b.yaml, counted on the meta device (no weights)."""
    config = load_config(
        REPO / "config" / "qwen2.5-7b.yaml", [f"model.projector={kind}", "model.llm.gradient_checkpointing=true"], check_paths=False
    )
    lora = config.model.llm.lora
    with torch.device("meta"):
        llm = Qwen2ForCausalLM(Qwen2Config(**QWEN25_7B))
        peft = get_peft_model(llm, LoraConfig(r=lora.r, lora_alpha=int(lora.alpha), target_modules=list(lora.target_modules)))
        projectors = [
            build_projector(kind, TOWER_WIDTH, config.model.projector_hidden, 3584, config.model.prefix_tokens, layout)  # type: ignore[arg-type]
            for layout in ("grid", "sequence")
        ]
    lora_count = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    return lora_count + sum(p.numel() for projector in projectors for p in projector.parameters())


def test_the_7b_presets_trainable_state_is_the_size_of_lora() -> None:
    """About 100M parameters at most, LoRA included, and a checkpoint of at most 1.5 GB (fp32
    weights and AdamW's two moments); the pooled projector was 946M for two modalities."""
    tokens, pooled = trainable_at_the_7b_preset("tokens"), trainable_at_the_7b_preset("pooled")
    assert tokens <= 100e6, tokens
    assert tokens * 4 * 3 <= 1.5e9
    assert pooled - tokens > 900e6  # what the choice saves
    assert isinstance(build_projector("tokens", 8, 8, 8, 2, "grid"), TokenProjector)
