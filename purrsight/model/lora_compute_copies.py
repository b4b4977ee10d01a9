"""LoRA's adapters in autocast's dtype: one cast of a layer's adapters a micro-batch, not one at each use.

peft keeps the adapters in float32 over a bf16 base (the optimizer's precision). Under autocast
each adapter matmul copies its float32 weight to bf16: once in the forward (autocast's cache lasts
one autocast region), again in gradient checkpointing's recomputation (a new region, in
backward), and its bf16 gradient is copied back to float32 for accumulation. At the 0.5B preset
that is 24 layers x 7 projections x 2 matrices x 3 = 1,008 copies a micro-batch, each a kernel
launch on a GPU (bench/results/gpu.md).

Here, when a decoder layer's forward begins, its adapters' bf16 copies are made in one
``torch._foreach_copy_`` (on CUDA one multi-tensor kernel for the whole list, converting dtypes);
the adapters read them in the forward and in the recomputation; their gradients go back to
float32 in one more. The arithmetic is autocast's own: the same bf16 values into the same
matmuls, the same bf16 gradients cast to float32 and accumulated into the float32 weights, so a
step is bit-identical (tests/unit/test_lora_compute_copies.py).

Made at the layer's start, not all at once before the model: autograd runs ready nodes newest
first, so copies made before the forward would get their gradients only at the end of backward,
and DDP could not all-reduce a layer's adapters while backward goes on through the layers below.
The hook that makes them is a forward pre-hook, which transformers runs outside the layer's
checkpoint (once a forward, not again in the recomputation).

Copies exist from ``refresh`` until ``release``, which the trainer calls around each micro-batch
(``release`` when its backward and any optimizer step are done); an optimizer step (the trainer's
hook) and a state-dict load release them too, so one that an exception left behind is gone
before the weights change. Outside a window the adapters read their own weights and autocast
casts them: a forward outside a training or validation step never sees copies older than the
weights.

Not installed under fsdp, whose all-gather hands the layers bf16 weights already
(training/fsdp.py), outside a mixed precision, or under trainer.compile, where the casts are ops
of each layer's compiled graph (and of its CUDA graph). Should peft ever read an adapter's weight
itself instead of calling its module, the copies would go unused and autocast would cast as
before: slower, never wrong (the tests count the casts).
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.functional import linear


class _CastAll(torch.autograd.Function):
    """float32 weights -> their copies in ``dtype``, in one op; gradients back to float32 in one."""

    @staticmethod
    def forward(ctx: Any, dtype: torch.dtype, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # An adapter no forward used (another peft adapter, inactive) gets None, as under
        # autocast, not zeros: AdamW would decay it and DDP would not see it unused.
        ctx.set_materialize_grads(False)
        copies = [torch.empty_like(weight, dtype=dtype) for weight in weights]
        torch._foreach_copy_(copies, list(weights))
        return tuple(copies)

    @staticmethod
    @once_differentiable  # no double backward through the copies (autocast's casts had one): said, not wrong
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        present = [grad for grad in grads if grad is not None]
        widened = [torch.empty_like(grad, dtype=torch.float32) for grad in present]
        if present:
            torch._foreach_copy_(widened, present)
        found = iter(widened)
        return (None, *(None if grad is None else next(found) for grad in grads))


class AdapterLinear(nn.Linear):
    """A LoRA A or B matrix that computes with its compute copy while one is made.

    The class an adapter's ``nn.Linear`` is switched to in place (as FSDP2's ``fully_shard``
    switches a module's class): same parameters, same state-dict names, peft's code unchanged."""

    compute_copies: AdapterComputeCopies
    compute_index: int

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        current = self.compute_copies.current
        copy = None if current is None else current[self.compute_index]
        return linear(input, self.weight if copy is None else copy, self.bias)


class AdapterComputeCopies:
    """The adapters of one model, in groups (one a decoder layer), and within a micro-batch their
    copies in autocast's dtype, each group's made when its layer's forward begins."""

    def __init__(self, groups: list[list[AdapterLinear]]) -> None:
        self.groups = groups
        adapters = [adapter for group in groups for adapter in group]
        for index, adapter in enumerate(adapters):  # each adapter's place in ``current``
            adapter.compute_copies, adapter.compute_index = self, index
        self.count = len(adapters)
        self._first = [group[0].compute_index for group in groups]
        self.current: list[torch.Tensor | None] | None = None
        self._dtype = torch.bfloat16

    def refresh(self, device_type: str) -> None:
        """Opens the window for the forward about to run: each layer's copies are made, in the
        dtype autocast computes in on ``device_type``, as the layer begins; none where autocast is
        off there (the adapters then use their weights)."""
        self.current = None
        if torch.is_autocast_enabled(device_type):
            self._dtype = torch.get_autocast_dtype(device_type)
            self.current = [None] * self.count

    def make_group(self, group: int) -> None:
        """The copies of ``group``'s adapters, unless the window is shut or they are made already
        (in a mode that serves this forward: copies made without a graph serve no training one)."""
        current, first = self.current, self._first[group]
        if current is None:
            return
        made = current[first]
        if made is not None and (made.requires_grad or not torch.is_grad_enabled()):
            return
        copies = _CastAll.apply(self._dtype, *(adapter.weight for adapter in self.groups[group]))
        current[first : first + len(copies)] = copies

    def release(self, *_: object) -> None:
        """After the micro-batch's backward: the weights may change now. Takes and ignores a hook's
        arguments (an optimizer's step post-hook, a state-dict load's post-hook)."""
        self.current = None

    def __getstate__(self) -> dict[str, Any]:
        # A copied or pickled model starts with its window shut (an open one holds graph tensors).
        return {**self.__dict__, "current": None}


class _MakeGroupCopies:
    """The forward pre-hook of a group's layer: an object, not a closure, so that a deep copy of
    the model gets hooks that make the copy's own copies."""

    def __init__(self, copies: AdapterComputeCopies, group: int) -> None:
        self.copies, self.group = copies, group

    def __call__(self, *_: object) -> None:
        self.copies.make_group(self.group)


def use_adapter_compute_copies(model: nn.Module, precision: str) -> AdapterComputeCopies | None:
    """Switches every plain LoRA adapter of ``model`` (not DoRA's or another variant's, which read
    their weights themselves) to compute with copies made once a micro-batch, one group for each
    numbered layer (``...layers.3``) with a pre-hook there that makes them; None when ``precision``
    is not a mixed one (no autocast: nothing to save) or there are no adapters."""
    if not precision.endswith("-mixed"):
        return None
    groups: dict[str, list[AdapterLinear]] = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        variants: dict[str, Any] = getattr(layer, "lora_variant", {})
        for key in layer.lora_A:
            if key in variants:
                continue
            for matrix in (layer.lora_A[key], layer.lora_B[key]):
                if type(matrix) is nn.Linear:
                    matrix.__class__ = AdapterLinear
                    groups.setdefault(numbered_layer(name), []).append(matrix)  # type: ignore[arg-type]  # switched above
    if not groups:
        return None
    copies = AdapterComputeCopies(list(groups.values()))
    model.register_load_state_dict_post_hook(copies.release)
    for group, owner in enumerate(groups):
        model.get_submodule(owner).register_forward_pre_hook(_MakeGroupCopies(copies, group))
    return copies


def numbered_layer(name: str) -> str:
    """The module path up to its first numbered part (``...layers.3``): the decoder layer, in
    every Hugging Face LM; the whole name where there is none."""
    parts = name.split(".")
    numbered = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 1)
    return ".".join(parts[: numbered + 1])


def installed_compute_copies(model: nn.Module) -> AdapterComputeCopies | None:
    """The compute copies ``use_adapter_compute_copies`` installed in ``model``, if it did."""
    return next((m.compute_copies for m in model.modules() if isinstance(m, AdapterLinear)), None)
