"""The frozen Phase 1 aligner: per-modality linear heads into a shared space.

File format (what Phase 1 saves, loaded with ``torch.load(weights_only=True)``): a dict of
tensors, optionally nested under ``"state_dict"``, with the keys
``image.weight [dim, image_width]``, ``image.bias [dim]``, ``audio.weight [dim, audio_width]``
and ``audio.bias [dim]`` for each enabled modality.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from purrsight.model.loading import ModelLoadError


class Phase1Aligner(nn.Module):
    def __init__(self, widths: dict[str, int], dim: int) -> None:
        super().__init__()
        self.heads = nn.ModuleDict({name: nn.Linear(width, dim) for name, width in widths.items()})
        self.dim = dim
        self.requires_grad_(False)

    def forward(self, modality: str, features: torch.Tensor) -> torch.Tensor:
        return self.heads[modality](features)


def load_aligner(path: str | Path, widths: dict[str, int], dim: int) -> Phase1Aligner:
    """Build the aligner for ``widths`` and fill it from ``path``; names a missing or mis-shaped key."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: aligner checkpoint not found") from None
    except Exception as err:
        raise ModelLoadError(f"{path}: cannot load the aligner checkpoint safely (weights_only=True): {err}") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise ModelLoadError(f"{path}: expected a dict of tensors, got {type(state).__name__}")
    aligner = Phase1Aligner(widths, dim)
    for key, expected in aligner.heads.state_dict().items():
        if key not in state:
            raise ModelLoadError(f"{path}: aligner key {key!r} missing (expected shape {list(expected.shape)})")
        if not isinstance(state[key], torch.Tensor) or state[key].shape != expected.shape:
            got = list(state[key].shape) if isinstance(state[key], torch.Tensor) else type(state[key]).__name__
            raise ModelLoadError(f"{path}: aligner key {key!r} has shape {got}, expected {list(expected.shape)}")
    aligner.heads.load_state_dict({key: state[key] for key in aligner.heads.state_dict()})
    return aligner


def save_aligner(aligner: Phase1Aligner, path: str | Path) -> None:
    torch.save(aligner.heads.state_dict(), path)
