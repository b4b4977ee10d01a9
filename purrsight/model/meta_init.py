"""Modules whose parameters are created on the meta device: shapes without memory.

Buffers stay real: they are small and computed at construction (rotary frequencies), which
a later fill from the weight files would not redo.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.data.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """What this process holds of ``tensor``: its shard when FSDP made it a DTensor, else all of it."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def is_meta(tensor: torch.Tensor) -> bool:
    return local_part(tensor).device.type == "meta"
