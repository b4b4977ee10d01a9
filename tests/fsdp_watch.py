"""What FSDP2 really does while a model trains, measured, not summed from shard sizes.

- **The gathered peak**: the most parameter bytes held unsharded at once. FSDP2 swaps a unit's
  parameters for plain tensors while they are gathered and back to DTensor shards after, so the
  bytes of every parameter that is not a DTensor, read before and after each module's forward,
  are what is gathered at that moment. A layer left out of every unit stays gathered with the
  root for the whole step and shows here, where the sum of shard sizes cannot see it.
- **Reduce-scatters**: calls of torch.distributed's reduce-scatter, the collective FSDP2's
  default reduce issues once per unit with gradients at each synced backward.
- **The bound**: the model's blocks as the test knows them (towers, aligner, projectors,
  untied embeddings and head, the LLM's ``base_model.layers``), independent of how
  training/fsdp.py finds its units. One unit at a time gathered is at most the largest block
  plus what is in no block; a lost block makes it two blocks plus that.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle


def parameter_bytes(params: Any) -> int:
    """Whole-tensor bytes (a DTensor counts as the tensor it shards) in each one's own dtype."""
    return sum(p.numel() * p.element_size() for p in params)


class GatheredPeak:
    """The largest number of parameter bytes ``model`` held unsharded at once during forwards."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.peak = 0
        self.samples = 0
        self._handles: list[RemovableHandle] = []
        for module in model.modules():
            # Registered after fully_shard: a unit's own pre-forward (the all-gather) runs before
            # ours and its post-forward (the reshard) before ours too.
            self._handles.append(module.register_forward_pre_hook(lambda *_: self._sample()))
            self._handles.append(module.register_forward_hook(lambda *_: self._sample()))

    def _sample(self) -> None:
        gathered = parameter_bytes(p for p in self.model.parameters() if not isinstance(p, DTensor))
        self.peak = max(self.peak, gathered)
        self.samples += 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def blocks(model: Any) -> list[nn.Module]:
    """The PurrSight model's blocks: the parts that can each be gathered on their own."""
    llm = model.llm
    parts: list[nn.Module] = [*model.encoders.values(), *model.projectors.values()]
    if model.aligner is not None:
        parts.append(model.aligner)
    embeddings, head = llm.get_input_embeddings(), llm.get_output_embeddings()
    if head is None or head.weight is not embeddings.weight:  # tied, they are used at both ends: the root keeps them
        parts.append(embeddings)
        if head is not None:
            parts.append(head)
    parts += list(llm.get_base_model().base_model.layers)
    return parts


def one_unit_bound(model: nn.Module) -> int:
    """The gathered bytes when one block at a time is gathered: the largest block plus the rest
    (final norm, tied embeddings) that no block holds, which stays with the root for the step.

    A block lost from the units stays gathered with that rest, so while any other block is
    gathered the total is the rest plus two blocks: above this bound, whichever block is lost."""
    sizes = [parameter_bytes(part.parameters()) for part in blocks(model)]
    return max(sizes) + parameter_bytes(model.parameters()) - sum(sizes)


@contextmanager
def counting_reduce_scatters() -> Iterator[list[int]]:
    """``[count]`` of the reduce-scatters issued inside, by wrapping torch's own functions: FSDP2
    calls ``reduce_scatter_single`` in torch 2.13, ``reduce_scatter_tensor`` in earlier ones (a
    GPU node's build may be older). A call made inside a counted one is the same collective."""
    count, depth = [0], [0]
    originals = {name: getattr(dist, name) for name in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, name)}

    def counting(original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            count[0] += depth[0] == 0
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    for name, original in originals.items():
        setattr(dist, name, counting(original))
    try:
        yield count
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def units_with_gradients(model: nn.Module) -> int:
    """FSDP units holding trainable parameters of their own (none of a unit inside them): each
    issues one reduce-scatter per synced backward."""
    from torch.distributed.fsdp import FSDPModule

    count = 0
    for unit in model.modules():
        if not isinstance(unit, FSDPModule):
            continue
        inner = [child for child in unit.modules() if child is not unit and isinstance(child, FSDPModule)]
        below = {id(p) for child in inner for p in child.parameters()}
        if any(p.requires_grad and id(p) not in below for p in unit.parameters()):
            count += 1
    return count


def bf16_policy_dtypes(device: torch.device, mesh: Any, model: Any, batch: dict[str, Any]) -> dict[str, str]:
    """``model`` sharded under bf16-mixed's policy on ``mesh``, one forward (under autocast, as
    Lightning's bf16-mixed runs it) and backward: the dtypes a LoRA and a projector weight have
    while gathered, the sharded trainable parameters and their gradients, and the frozen ones."""
    from purrsight.training.fsdp import mixed_precision, shard_model

    shard_model(model, mesh, mixed_precision("bf16-mixed"))
    seen: dict[str, str] = {}
    lora = next(m for n, m in model.named_modules() if n.endswith("lora_A.default"))
    projector = next(m for m in next(iter(model.projectors.values())).modules() if isinstance(m, nn.Linear))
    for name, module in (("lora_gathered", lora), ("projector_gathered", projector)):
        module.register_forward_pre_hook(lambda mod, _args, name=name: seen.setdefault(name, str(mod.weight.dtype)) and None)
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(batch)[0]
    loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad and p.is_floating_point()]
    seen["trainable_sharded"] = ",".join(sorted({str(p.dtype) for p in trainable}))
    seen["gradients"] = ",".join(sorted({str(p.grad.dtype) for p in trainable if p.grad is not None}))
    seen["frozen"] = ",".join(sorted({str(p.dtype) for p in frozen}))
    seen["loss_finite"] = str(bool(torch.isfinite(loss).item()))
    return seen
