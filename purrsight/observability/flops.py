"""FLOP accounting: training FLOPs per token of the Phase 2 model and the GPUs' peak rates.

Free of Lightning: the telemetry callback (telemetry.py) turns these into MFU during training,
and the benchmarks (bench/) use them to say what one GPU consumes without loading a trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from purrsight.model.multimodal import PurrSightModel

PEAK_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0}  # bf16 dense, per GPU (vendor figures)


def flops_per_token(llm_params: int, trainable_params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token for a frozen LLM with LoRA (multiply-add = 2 FLOPs).

    forward 2N, backward through the frozen weights to their inputs 2N (their own weight
    gradients are skipped), trainable weights' gradients 2T on top of their forward and
    input-gradient share; attention scores and values 2 x 2 x seq_len x hidden per layer
    forward, twice that backward: 12 x layers x hidden x seq_len.
    """
    return 4 * llm_params + 2 * trainable_params + 12 * layers * hidden * seq_len


def model_flops_per_token(model: PurrSightModel | None, seq_len: int) -> float | None:
    """flops_per_token() for the built Phase 2 model (None before it exists)."""
    if model is None:
        return None
    config = cast("PreTrainedModel", model.llm.get_base_model()).config
    llm_params = sum(p.numel() for p in model.llm.parameters())
    # Per token: the LoRA adapters. The projectors run once per sample, not per token
    # (6 x their parameters per sample: under 0.1% at the real size), so they are left out.
    trainable = sum(p.numel() for p in model.llm.parameters() if p.requires_grad)
    return flops_per_token(llm_params, trainable, config.num_hidden_layers, config.hidden_size, seq_len)


def gpu_peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)
