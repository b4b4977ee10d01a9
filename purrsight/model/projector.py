"""Trainable projectors: one modality feature vector -> ``num_tokens`` LLM prefix embeddings."""

from __future__ import annotations

import torch
from torch import nn


class Projector(nn.Module):
    def __init__(self, in_dim: int, hidden: int, out_dim: int, num_tokens: int) -> None:
        super().__init__()
        self.num_tokens = num_tokens
        self.out_dim = out_dim
        self.net = nn.Sequential(
            nn.LayerNorm(in_dim),  # encoders differ wildly in output scale; normalise first
            nn.Linear(in_dim, hidden),
            nn.GELU(),
            nn.Linear(hidden, num_tokens * out_dim),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features).view(features.shape[0], self.num_tokens, self.out_dim)
