"""FSDP2 for a frozen base with LoRA on top (``distributed.strategy: fsdp``).

What outgrows a GPU is the frozen weights, so they are what is sharded: each LLM decoder
layer, the embeddings and an untied LM head, each encoder tower, the aligner and each projector
become FSDP units over every rank; the root unit takes the rest (the final norm, tied
embeddings), so every trainable parameter's gradient is reduced. LoRA is applied before sharding: peft
builds its shapes from the whole weight.

The decoder layers are the modules the model itself declares unsplittable (Hugging Face's
``_no_split_modules``), and there must be ``num_hidden_layers`` of them: a layer left out of
every unit would silently fall into the root one, which is gathered whole for the whole step.

As torchtitan does: under bf16-mixed the units gather and compute in bf16 and reduce gradients in
fp32 (``MixedPrecisionPolicy``), and the sharded trainable parameters stay fp32 for the optimizer.
Unlike torchtitan, which trains every weight, gradients are reduce-scattered once per
accumulation window, at its last micro-batch: only the trainable parameters have gradients, so
keeping them unsharded over a window costs what DDP keeps, not a whole model's.

Checkpoints keep the file DDP writes: the trainable weights gathered whole on rank 0 (never
the frozen base) and the optimizer state keyed by position, as ``Optimizer.state_dict()``
keys it. A run therefore resumes under either strategy and on another world size, and
``train_phase2.py export`` reads either.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from pytorch_lightning.core.optimizer import LightningOptimizer
from pytorch_lightning.plugins.environments import ClusterEnvironment
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from purrsight.config import Config
from purrsight.internals.transformers_keys import loaded_names
from purrsight.model.linear_cross_entropy import LOSS_METHOD
from purrsight.model.llm import decoder_layers, lora_a_init
from purrsight.model.loading import ModelLoadError
from purrsight.model.meta_init import is_meta, local_part
from purrsight.model.multimodal import PurrSightModel
from purrsight.model.weight_files import WeightFiles, file_key, weight_keys
from purrsight.runs.checkpoint_saver import AtomicCheckpointIO
from purrsight.training.fingerprint import FingerprintParts
from purrsight.training.model_builder import BuiltModel, build_model

TRAINABLES_WHOLE_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)


def fsdp_units(model: PurrSightModel) -> list[nn.Module]:
    """The modules sharded as units of their own, in forward order (the root unit is the rest)."""
    llm = model.llm
    units: list[nn.Module] = [tower for tower in model.encoders.values()]
    if model.aligner is not None:
        units.append(model.aligner)
    # Units of their own, not the root's: the root stays gathered for the whole step, and a
    # unit's policy casts what enters it, so under bf16-mixed a projector's first LayerNorm
    # sees bf16 input with its bf16-gathered weight (CPU autocast leaves that pair mismatched).
    units += list(model.projectors.values())
    embeddings, head = llm.get_input_embeddings(), llm.get_output_embeddings()
    tied = head is not None and head.weight is embeddings.weight
    if not tied:  # a tied head shares its weight: both stay in the root unit, which holds it for the whole step
        units.append(embeddings)
    units += decoder_layers(llm)
    if head is not None and not tied:
        units.append(head)
    return units


def mixed_precision(precision: str) -> Any:
    """FSDP2's policy under a Lightning precision: under bf16-mixed the units gather their
    parameters in bf16 (the frozen ones already are; the trainable fp32 ones are cast once per
    gather instead of by autocast at every op) and reduce gradients in fp32. fp32, as torchtitan
    reduces: the reduce sums every rank's gradient, and with sync held over a window FSDP
    accumulates the micro-batches' gradients in this dtype too; the bytes are the trainable
    gradients' only (LoRA and projectors). None otherwise: 32-true keeps fp32 throughout."""
    if precision != "bf16-mixed":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_model(model: PurrSightModel, mesh: Any, policy: Any = None) -> int:
    """Shard ``model`` in place over ``mesh`` (with ``policy``, a ``MixedPrecisionPolicy`` or None);
    the number of units (the root included)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    units = fsdp_units(model)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
    fully_shard(model, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
    # The loss calls the head through this method, not its forward: an untied head, a unit of its
    # own, must be gathered around it too (a tied one is in the root unit: a no-op for it).
    register_fsdp_forward_method(model.head, LOSS_METHOD)
    model.encode_every_step = True  # every rank must run every unit's all-gather, images or not
    return len(units) + 1


def materialize(model: nn.Module, device: torch.device) -> set[str]:
    """Storage for the shards of what was built on the meta device; the names of those parameters.

    ``to_empty`` must run on the root (FSDP resets its shards there) and empties every tensor,
    so what was already real (towers, projectors, buffers) is kept aside and put back.
    """
    on_meta = {name for name, param in model.named_parameters() if is_meta(param)}
    tensors = list(itertools.chain(model.named_parameters(), model.named_buffers()))
    kept = {name: local_part(tensor).detach().clone() for name, tensor in tensors if not is_meta(tensor)}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
            if name in kept:
                local_part(tensor).copy_(kept[name])
    return on_meta


def _rows_held(param: torch.Tensor) -> tuple[int, int]:
    """The rows of the whole tensor this rank's shard holds (FSDP2 splits dim 0 as torch.chunk)."""
    if not hasattr(param, "device_mesh"):
        return 0, param.shape[0] if param.dim() else 1
    mesh = param.device_mesh
    chunk = math.ceil(param.shape[0] / mesh.size())
    start = min(mesh.get_local_rank() * chunk, param.shape[0])
    return start, start + local_part(param).shape[0]


def fill(model: PurrSightModel, names: set[str], files: WeightFiles, seed: int, fingerprint: FingerprintParts) -> None:
    """The parameters built on meta, now materialized: frozen ones read from ``files`` (this
    rank's rows only, one tensor at a time, under the keys the model's own conversion gives
    them) and added to this rank's ``fingerprint`` as they are read, LoRA's initialised by name."""
    keys = weight_keys(model.llm.get_base_model(), files, loaded_names)
    hashed: set[str] = set()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name not in names:
                continue
            start, stop = _rows_held(param)
            local = local_part(param)
            if ".lora_A." in name:
                local.copy_(lora_a_init(name, param.shape, seed)[start:stop])
            elif ".lora_B." in name:
                local.zero_()
            elif file_key(name) in keys:
                key = keys[file_key(name)]
                rows = files.rows(key, start, stop)
                local.copy_(rows)
                if key not in hashed:  # a tied head: its embeddings' rows once
                    hashed.add(key)
                    fingerprint.add_share(key, rows, param.shape[0] if param.dim() else 1, start)
            else:
                raise ModelLoadError(f"{files.folder}: no tensor {file_key(name)} for the LLM's {name}")


def build_sharded(
    config: Config, frozen: torch.dtype, mesh: Any, device: torch.device, precision: str = "32-true"
) -> tuple[BuiltModel, int]:
    """The model of ``config`` sharded over ``mesh``, and its number of FSDP units.

    An LLM from a directory is built on the meta device and filled after sharding, each rank
    reading its own rows; one built from a config dict is built whole first (it is small).
    ``precision``: Lightning's, which decides the mixed-precision policy (``mixed_precision``).
    """
    llm_path = config.model.llm.path
    group = mesh.get_group()
    built = build_model(config, frozen, llm_on_meta=llm_path is not None, fingerprint_group=group)
    units = shard_model(built.model, mesh, mixed_precision(precision))
    on_meta = materialize(built.model, device)
    if on_meta:
        assert llm_path is not None and built.fingerprint_parts is not None
        try:
            fill(built.model, on_meta, WeightFiles(llm_path), config.run.seed, built.fingerprint_parts)
        except Exception as error:  # raised on every rank by combined: none waits for this one
            built.fingerprint_parts.error = error
        built.fingerprint = built.fingerprint_parts.combined(group)
    return built, units


def local_frozen_bytes(model: nn.Module) -> int:
    """Bytes of frozen weights this rank holds: its shards under FSDP, everything under DDP."""
    total = 0
    for param in model.parameters():
        if not param.requires_grad:
            local = local_part(param)
            total += local.numel() * local.element_size()
    return total


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _names_in_order(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    names = {id(param): name for name, param in module.named_parameters()}
    return [names[id(param)] for group in optimizer.param_groups for param in group["params"]]


def by_position(state: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name, keyed by position as ``Optimizer.state_dict()`` does."""
    position = {name: index for index, name in enumerate(names)}
    return {
        "state": {position[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [position[name] for name in group["params"]]} for group in state["param_groups"]],
    }


def by_name(state: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of ``by_position``."""
    return {
        "state": {names[int(index)]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[int(index)] for index in group["params"]]} for group in state["param_groups"]],
    }


class ShardedFrozenBase(ModelParallelStrategy):
    """Lightning's FSDP2 strategy, data parallel over every rank, with trainable-only checkpoints."""

    def __init__(
        self, environment: ClusterEnvironment, backend: str, timeout: timedelta, device: torch.device | None = None
    ) -> None:
        super().__init__(save_distributed_checkpoint=False, process_group_backend=backend, timeout=timeout)
        self.cluster_environment = environment
        self.checkpoint_io = AtomicCheckpointIO()
        self._assigned_device = device

    @property
    def root_device(self) -> torch.device:
        return self._assigned_device if self._assigned_device is not None else super().root_device

    def setup_environment(self) -> None:
        # Lightning's "auto" builds a tensor-parallel mesh of each node's processes, which
        # shards nothing here: every rank is a data-parallel shard holder instead.
        self._data_parallel_size = self.num_nodes * self.num_processes
        self._tensor_parallel_size = 1
        super().setup_environment()

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this for each micro-batch of an accumulation window but the last (its
        own version holds back DDP only): FSDP keeps the unsharded trainable gradients and
        reduce-scatters them once, at the window's last backward. A window an epoch ends early
        ends where Lightning steps, so it is reduced there as well."""
        from torch.distributed.fsdp import FSDPModule

        roots = [module for module in (self.model.modules() if self.model is not None else ()) if isinstance(module, FSDPModule)]
        if not roots:
            yield
            return
        roots[0].set_requires_gradient_sync(False)  # the outermost unit; recursing reaches every one
        try:
            yield
        finally:
            roots[0].set_requires_gradient_sync(True)

    @property
    def lightning_restore_optimizer(self) -> bool:
        return True  # load_optimizer_state_dict below, from our file

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return get_model_state_dict(self.model, options=TRAINABLES_WHOLE_ON_RANK0)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        assert self.model is not None
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        whole = get_optimizer_state_dict(self.model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return by_position(whole, _names_in_order(self.model, optimizer)) if self.global_rank == 0 else {}

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.model is not None
        set_model_state_dict(
            self.model, dict(checkpoint["state_dict"]), options=StateDictOptions(full_state_dict=True, strict=False)
        )

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.model is not None
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            named = by_name(saved, _names_in_order(self.model, optimizer))
            set_optimizer_state_dict(self.model, optimizer, named, options=StateDictOptions(full_state_dict=True))
