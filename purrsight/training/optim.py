"""AdamW over the trainable parameters with linear warmup and a cosine decay."""

from __future__ import annotations

import math

import torch

from purrsight.config import OptimConfig


def warmup_cosine(step: int, warmup: int, total: int, floor: float) -> float:
    """LR multiplier: linear 0 -> 1 over ``warmup`` steps, then cosine 1 -> ``floor`` at ``total``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(
    parameters: list[torch.nn.Parameter], optim: OptimConfig, total_steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer and its per-step schedule (step the scheduler after every optimizer step)."""
    beta1, beta2 = optim.betas
    # On GPUs the fused kernel: one launch for all parameters, and its step counters stay on
    # the device (the default keeps them on the host and reads each one per step).
    fused = bool(parameters) and all(p.is_cuda for p in parameters)
    optimizer = torch.optim.AdamW(
        parameters, lr=optim.lr, betas=(beta1, beta2), weight_decay=optim.weight_decay, fused=fused or None
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, optim.warmup_steps, total_steps, optim.min_lr_ratio)
    )
    return optimizer, scheduler
