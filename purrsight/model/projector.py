"""Trainable projectors: a modality's encoder output -> ``num_tokens`` LLM prefix embeddings.

Two kinds, chosen by ``model.projector``:

- ``tokens`` (the default): the encoder's token sequence (a picture's patches, a recording's
  frames) is reduced to ``num_tokens`` by adaptive average pooling, over the patch grid for a
  picture (a 14x14 grid to 4x8 for 32 tokens) and over time for a recording, and each pooled
  token goes through the same two-layer MLP into the LLM's width (LLaVA-1.5's projector, after
  a Qwen2-VL-style merge of neighbouring patches). Why pooling and not an attention resampler
  (BLIP-2's Q-Former, Flamingo's Perceiver): at a fixed token count, locality-preserving
  reduction of the grid matched or beat learned-query resamplers in Honeybee's comparison
  (Cha et al., CVPR 2024) and in LLaVA-style ablations, and it adds no parameters, no attention
  and nothing to tune; the LLM keeps where in the picture, and when in the recording, each
  token came from. Its weights do not grow with ``num_tokens``: about 19M per modality at the
  7B preset.
- ``pooled`` (runs made before it): one mean-pooled vector per sample through an MLP whose last
  layer writes all ``num_tokens x out_dim`` values at once; at the 7B preset 470M parameters a
  modality. Kept so that those runs resume.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn
from torch.nn import functional

ProjectorKind = Literal["tokens", "pooled"]


Layout = Literal["grid", "sequence"]


def pooled_tokens(tokens: torch.Tensor, num_tokens: int, layout: Layout) -> torch.Tensor:
    """(batch, n, width) -> (batch, num_tokens, width) by adaptive average pooling.

    ``grid`` (a picture's patches): a square token count, or a square plus one leading class
    token (dropped), is pooled in 2-D to the grid of ``num_tokens`` closest to square, in raster
    order; any other count falls back to the sequence rule. ``sequence`` (audio frames): pooled
    over time. Fewer tokens than asked are repeated (adaptive pooling's bins then overlap).
    """
    count = tokens.shape[1]
    side = math.isqrt(count)
    if layout == "grid" and side * side != count and count > 2 and math.isqrt(count - 1) ** 2 == count - 1:
        tokens, count, side = tokens[:, 1:], count - 1, math.isqrt(count - 1)  # ViT's class token
    if layout == "grid" and side * side == count and side > 1:
        rows = max(d for d in range(1, math.isqrt(num_tokens) + 1) if num_tokens % d == 0)
        grid = tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], side, side)
        pooled = functional.adaptive_avg_pool2d(grid, (rows, num_tokens // rows))
        return pooled.flatten(2).transpose(1, 2)
    return functional.adaptive_avg_pool1d(tokens.transpose(1, 2), num_tokens).transpose(1, 2)


class TokenProjector(nn.Module):
    """Pooled encoder tokens -> LLM embeddings, one shared MLP per token."""

    kind: ProjectorKind = "tokens"

    def __init__(self, in_dim: int, hidden: int, out_dim: int, num_tokens: int, layout: Layout = "sequence") -> None:
        super().__init__()
        self.num_tokens = num_tokens
        self.layout = layout
        self.reduced_tokens = num_tokens
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.net = nn.Sequential(
            nn.LayerNorm(in_dim),  # encoders differ wildly in output scale; normalise first
            nn.Linear(in_dim, hidden),
            nn.GELU(),
            nn.Linear(hidden, out_dim),
        )

    def reduce(self, tokens: torch.Tensor) -> torch.Tensor:
        """What the projector reads of an encoder's output: ``num_tokens`` pooled tokens."""
        return pooled_tokens(tokens, self.num_tokens, self.layout)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)


class Projector(nn.Module):
    """One pooled feature vector -> ``num_tokens`` LLM embeddings (the ``pooled`` projector)."""

    kind: ProjectorKind = "pooled"

    def __init__(self, in_dim: int, hidden: int, out_dim: int, num_tokens: int, layout: Layout = "sequence") -> None:
        super().__init__()
        self.num_tokens = num_tokens
        self.reduced_tokens = 1
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.net = nn.Sequential(
            nn.LayerNorm(in_dim),  # encoders differ wildly in output scale; normalise first
            nn.Linear(in_dim, hidden),
            nn.GELU(),
            nn.Linear(hidden, num_tokens * out_dim),
        )

    def reduce(self, tokens: torch.Tensor) -> torch.Tensor:
        """The mean over the encoder's tokens, as one "token"."""
        return tokens.mean(dim=1, keepdim=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features[:, 0]).view(features.shape[0], self.num_tokens, self.out_dim)


PROJECTORS: dict[str, type[TokenProjector] | type[Projector]] = {"tokens": TokenProjector, "pooled": Projector}


def build_projector(
    kind: ProjectorKind, in_dim: int, hidden: int, out_dim: int, num_tokens: int, layout: Layout
) -> TokenProjector | Projector:
    return PROJECTORS[kind](in_dim, hidden, out_dim, num_tokens, layout)
