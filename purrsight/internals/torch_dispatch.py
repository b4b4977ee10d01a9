"""Tensor bytes alive while PyTorch code runs, seen through its Python dispatch (written against torch 2.13).

``torch.utils._python_dispatch.TorchDispatchMode`` sees every aten op below autograd, forward and
backward alike; each output's storage is recorded once, and a weak reference to it (storages keep
their Python object as long as the storage lives) records its release. Used on the meta device,
where no byte is allocated, so the same code that trains tells what it would hold
(estimate/memory.py). On meta, ``scaled_dot_product_attention`` would pick its math path, which
keeps every attention matrix in fp32; ``fused_attention`` routes it, for the time of a step, to the
memory-efficient kernel a GPU takes with a mask (``aten._scaled_dot_product_efficient_attention``,
whose meta version and backward exist for torch.compile's fake tensors).
Checked: tests/unit/test_memory_estimate.py counts a known step's peak.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass
class Allocation:
    nbytes: int
    tag: str  # what the caller's classifier called the tensor that created it


@dataclass
class LiveBytes(TorchDispatchMode):  # type: ignore[misc]  # torch ships the base untyped
    """Inside ``with LiveBytes(classify):``: the peak of the bytes of storages created inside,
    and at that peak, how many bytes each tag held. ``classify(tensor)`` tags a new storage."""

    classify: Callable[[torch.Tensor], str] = lambda tensor: "other"
    live: dict[int, Allocation] = field(default_factory=dict)
    peak_bytes: int = 0
    at_peak: dict[str, int] = field(default_factory=dict)
    _now: dict[str, int] = field(default_factory=dict)  # bytes held now, by tag
    _total: int = 0

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # An output on an input's storage is a view or an in-place result: nothing new (a view of
        # a weight made before the mode was entered must not count as the step's).
        inputs = {id(leaf.untyped_storage()) for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and id(tensor.untyped_storage()) not in inputs:
                self._record(tensor)
        return out

    def _record(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.live:
            return
        allocation = Allocation(storage.nbytes(), self.classify(tensor))
        self.live[key] = allocation
        weakref.finalize(storage, self._release, key)
        self._now[allocation.tag] = self._now.get(allocation.tag, 0) + allocation.nbytes
        self._total += allocation.nbytes
        if self._total > self.peak_bytes:
            self.peak_bytes = self._total
            self.at_peak = dict(self._now)

    def _release(self, key: int) -> None:
        allocation = self.live.pop(key, None)
        if allocation is not None:
            self._now[allocation.tag] -= allocation.nbytes
            self._total -= allocation.nbytes


def _efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    if enable_gqa and key.shape[1] != query.shape[1]:  # the kernel takes as many key heads as query heads
        key = key.repeat_interleave(query.shape[1] // key.shape[1], 1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], 1)
    bias = attn_mask
    if bias is not None and bias.dtype == torch.bool:  # as sdpa converts a boolean mask
        bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device).masked_fill(~bias, float("-inf"))
    if bias is not None:
        bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention
    return efficient(query, key, value, bias, True, dropout_p, is_causal, scale=scale)[0]  # type: ignore[no-any-return]


@contextmanager
def fused_attention() -> Iterator[None]:
    """``torch.nn.functional.scaled_dot_product_attention`` runs the memory-efficient kernel (on meta)."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention
    functional.scaled_dot_product_attention = _efficient_attention  # type: ignore[assignment]
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original
