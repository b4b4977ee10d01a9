"""Per-GPU bytes of one training step under ddp and fsdp, from the config's model on meta.

What is counted, per GPU:

- **frozen**: the frozen weights (LLM base, towers, aligner) in the dtype training holds them
  (``model_builder.frozen_dtype``: bf16 under bf16 precisions, else fp32); fsdp: 1/N of them.
- **trainable**, **gradients**, **optimizer**: LoRA and the projectors in fp32 (bf16 under
  bf16-true), a gradient each, AdamW's two moments; fsdp: 1/N. ddp without
  ``distributed.gradient_as_bucket_view`` keeps a second copy of the gradients in its buckets; fsdp
  with ``trainer.accumulate_grad_batches`` > 1 keeps whole fp32 gradients over the window (it
  reduce-scatters once per window, training/fsdp.py).
- **all-gather** (fsdp only): the root unit, gathered for the whole step, plus the largest two
  neighbouring units in forward order, the one computing and the one prefetched, the second twice
  over while its flat all-gather output is copied out into its parameters (FSDP2's
  ``foreach_all_gather_copy_out``), in the gather dtype (bf16 under bf16-mixed).
- **activations** and **logits**: the peak of the tensors one micro-batch's forward and backward
  create, found by running that step on the meta device through the model's own code
  (``PurrSightModel.forward``, the LLM's loss, ``backward``) with every storage's birth and death
  recorded (internals/torch_dispatch.py). At the configured ``data.batch_size`` and the longest
  sample (``data.max_length`` text tokens plus every modality's prefix), with gradient
  checkpointing as ``model.llm.gradient_checkpointing`` says. bf16 precisions run the step with
  every tensor in bf16, which is what autocast computes in (its fp32 copies of LoRA's small
  weights are left out); 32-true in fp32. **logits** is the part of that peak of the vocabulary's
  width: the loss's, one chunk of rows at a time (model/linear_cross_entropy.py: at most 441 rows
  at a vocabulary of 152,064, whatever the batch or length), its logits in the compute dtype, their
  fp32 upcast and the gradient made from it; counted as if every text token carried a label (the
  most rows a batch can give). The LoRA gradients backward has made by the peak are in it too
  (counted twice in the worst case: at most the gradients' line).

Not counted: the CUDA context, NCCL's buffers and the caching allocator's fragmentation (together
1-5 GB on an 80 GB GPU: leave that much unclaimed), the data loader's pinned batches, and
transient kernel workspaces.

**Host memory per node** (``Estimate.host_per_node``): each rank's peak while it builds the model on
the CPU, times the ranks on a node. ddp: the LLM's frozen weights, in the dtype training holds them
(a base of safetensors is read straight into it, model/llm.py); fsdp: the rank's shard of them
plus one tensor's rows in flight (training/fsdp.py reads a tensor at a time). Both: the towers and
the aligner whole in fp32 (built so on every rank, then cast and, under fsdp, sharded), the
trainable weights, and PROCESS_HOST_BYTES (the interpreter with torch, transformers and Lightning
imported: 0.5 GB measured on CPU). An upper bound where a rank builds on its GPU: Lightning calls
``configure_model`` under the GPU's device, and transformers then reads the base onto it (not
measured here; a GPU rank maps CUDA's libraries on top, not counted either). Not counted: loader
workers, the page cache, a base of pytorch_model.bin (read in fp32, model/llm.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from purrsight.config import Config
from purrsight.estimate.meta_model import MetaModel, meta_model
from purrsight.internals.torch_dispatch import LiveBytes, fused_attention
from purrsight.model.llm import decoder_layers
from purrsight.model.loading import ModelLoadError
from purrsight.model.multimodal import PurrSightModel

STRATEGIES = ("ddp", "fsdp")
# "fits" keeps this much of a GPU for what is not counted (the CUDA context, NCCL, fragmentation:
# 1-5 GB); a total within the memory but not this far below it is "tight".
HEADROOM = 2 * 10**9
# A rank's host memory before any weight: the interpreter with the trainer's imports (the tiny
# default's rank peaks at 0.42 GiB on CPU, its model a few MB of it; 2026-11-28).
PROCESS_HOST_BYTES = 5 * 10**8
FSDP_ONE_PROCESS = "distributed.strategy=fsdp is refused with one process (training stops at start): train with ddp"


@dataclass(frozen=True)
class PerGpu:
    """Bytes one GPU holds at the step's peak, by kind."""

    frozen: int
    trainable: int
    gradients: int
    optimizer: int
    all_gather: int
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return sum(asdict(self).values())


@dataclass(frozen=True)
class Estimate:
    gpus: int
    precision: str
    frozen_parameters: int
    trainable_parameters: int
    checkpoint_bytes: int
    per_gpu: dict[str, PerGpu]
    refused: dict[str, str] = field(default_factory=dict)  # strategy -> why training refuses it here
    host_per_rank: dict[str, int] = field(default_factory=dict)  # strategy -> a rank's host peak at the build
    gpus_per_node: int = 1

    @property
    def host_per_node(self) -> dict[str, int]:
        """Host bytes a node needs while its ranks build the model (the module docstring)."""
        return {name: self.gpus_per_node * rank for name, rank in self.host_per_rank.items()}

    def fits(self, strategy: str, gpu_memory: int) -> bool:
        """The verdict "fits": room left for what is not counted, and a strategy training would start.
        (Until 2026-11-27 true for "tight" too: the JSON said fits where the table said tight.)"""
        return self.verdict(strategy, gpu_memory) == "fits"

    def verdict(self, strategy: str, gpu_memory: int) -> str:
        """refused, fits (HEADROOM left over), tight (within the memory, less left), or does not fit."""
        if strategy in self.refused:
            return "refused"
        total = self.per_gpu[strategy].total
        return "fits" if total + HEADROOM <= gpu_memory else "tight" if total <= gpu_memory else "does not fit"


def precision_of(config: Config) -> str:
    """The precision the GPUs train in: ``auto`` is bf16-mixed there (trainer_builder.py)."""
    precision = config.trainer.precision
    return "bf16-mixed" if precision == "auto" else precision


def _compute_dtype(precision: str) -> torch.dtype:
    return {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "16-mixed": torch.float16}.get(precision, torch.float32)


def _frozen_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision.startswith("bf16") else torch.float32  # model_builder.frozen_dtype


def _bytes(params: int, dtype: torch.dtype) -> int:
    return params * dtype.itemsize


def _numel(module: nn.Module, trainable: bool, seen: set[int]) -> int:
    """Parameters of ``module`` not counted yet (``seen``), trainable or frozen."""
    total = 0
    for param in module.parameters():
        if param.requires_grad == trainable and id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    return total


def fsdp_units(model: PurrSightModel) -> list[nn.Module]:
    """training/fsdp.py's units in forward order: towers, aligner, projectors, untied embeddings,
    decoder layers, untied head; the root unit holds the rest."""
    units: list[nn.Module] = [*model.encoders.values()]
    if model.aligner is not None:
        units.append(model.aligner)
    units += list(model.projectors.values())
    embeddings, head = model.llm.get_input_embeddings(), model.llm.get_output_embeddings()
    tied = head is not None and head.weight is embeddings.weight
    units += [] if tied else [embeddings]
    units += decoder_layers(model.llm)  # training/fsdp.py's own search, and its refusal
    units += [head] if head is not None and not tied else []
    return units


def gathered_bytes(model: PurrSightModel, frozen: torch.dtype, trainable: torch.dtype) -> int:
    """fsdp's unsharded parameters at their peak (the module docstring's all-gather line)."""
    seen: set[int] = set()
    units = [_bytes(_numel(u, False, seen), frozen) + _bytes(_numel(u, True, seen), trainable) for u in fsdp_units(model)]
    root = _bytes(_numel(model, False, seen), frozen) + _bytes(_numel(model, True, seen), trainable)
    pairs = [a + 2 * b for a, b in zip([0, *units], units, strict=False)]
    return root + max(pairs, default=0)


def step_peak(meta: MetaModel, config: Config, dtype: torch.dtype) -> tuple[int, int]:
    """(activations, logits): the peak bytes of one micro-batch's forward and backward, run on meta."""
    model = meta.model.to(dtype)
    model.zero_grad(set_to_none=True)  # a model priced before: backward makes its gradients anew, as a step's first does
    batch_size, length = config.data.micro_batch, config.data.max_length
    meta_device = torch.device("meta")
    batch: dict[str, object] = {
        "input_ids": torch.zeros(batch_size, length, dtype=torch.long, device=meta_device),
        "attention_mask": torch.ones(batch_size, length, dtype=torch.long, device=meta_device),
        "labels": torch.zeros(batch_size, length, dtype=torch.long, device=meta_device),
        "padded": True,  # the 4-D mask the attention kernel takes: the longer path
        "num_labelled": batch_size * length,  # every text token labelled: the loss's most rows
    }
    for modality, shape in meta.encoder_inputs.items():
        batch[modality] = torch.empty(batch_size, *shape, dtype=dtype, device=meta_device)
        batch[f"has_{modality}"] = torch.ones(batch_size, dtype=torch.bool, device=meta_device)
        batch[f"{modality}_rows"] = torch.arange(batch_size, device=meta_device)
    vocab = int(meta.llm_config.vocab_size)
    tracker = LiveBytes(
        lambda tensor: "logits" if tensor.dim() and tensor.shape[-1] == vocab else "activations",
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as autocast would: the model's own zeros and masks in the compute dtype
    try:
        model.train()
        with fused_attention(), tracker:  # a GPU's kernel with a mask: no attention matrix kept
            loss = model(batch).loss
            loss.backward()
            del loss
    finally:
        torch.set_default_dtype(default)
    return tracker.at_peak.get("activations", 0), tracker.at_peak.get("logits", 0)


@dataclass(frozen=True)
class Footprint:
    """What one GPU's share is computed from: counts and bytes that do not depend on the GPU count."""

    precision: str
    frozen_parameters: int
    trainable_parameters: int
    frozen_bytes: int  # all of them, in the dtype they are held in
    trainable_bytes: int  # all of them, in theirs
    all_gather: int
    activations: int
    logits: int
    largest_frozen_bytes: int  # the LLM's largest frozen tensor: fsdp's build reads one at a time
    tower_frozen_parameters: int  # frozen outside the LLM (towers, aligner): built whole in fp32 on every rank
    bucket_copy: bool  # ddp keeps its gradients a second time (gradient_as_bucket_view false)
    accumulates: bool  # accumulate_grad_batches > 1: fsdp keeps whole fp32 gradients over the window
    fsdp_refused: str | None = None  # why training/fsdp.py would refuse this model (its decoder layers)

    def per_gpu(self, strategy: str, gpus: int) -> PerGpu:
        weights, trainable = self.trainable_bytes, self.trainable_parameters
        if strategy == "ddp":
            gradients = weights * (2 if self.bucket_copy else 1)
            return PerGpu(self.frozen_bytes, weights, gradients, 2 * weights, 0, self.activations, self.logits)
        window = 4 * trainable if self.accumulates else 0
        return PerGpu(
            math.ceil(self.frozen_bytes / gpus),
            math.ceil(weights / gpus),
            math.ceil(weights / gpus) + window,
            math.ceil(2 * weights / gpus),
            self.all_gather,
            self.activations,
            self.logits,
        )

    def host_per_rank(self, strategy: str, gpus: int) -> int:
        """A rank's host peak while it builds the model (the module docstring's host memory)."""
        towers = 4 * self.tower_frozen_parameters
        llm = max(0, self.frozen_bytes - _frozen_dtype(self.precision).itemsize * self.tower_frozen_parameters)
        if strategy == "fsdp":
            llm = math.ceil(llm / gpus) + math.ceil(self.largest_frozen_bytes / gpus)
        return PROCESS_HOST_BYTES + llm + towers + self.trainable_bytes

    def estimate(self, gpus: int, gpus_per_node: int | None = None) -> Estimate:
        # A checkpoint holds the trainable weights and AdamW's two moments, fp32, gathered whole.
        per_gpu = {name: self.per_gpu(name, gpus) for name in STRATEGIES}
        checkpoint = 12 * self.trainable_parameters
        refused = {"fsdp": self.fsdp_refused or FSDP_ONE_PROCESS} if self.fsdp_refused or gpus == 1 else {}
        host = {name: self.host_per_rank(name, gpus) for name in STRATEGIES}
        per_node = min(gpus, gpus_per_node or 8)
        return Estimate(
            gpus, self.precision, self.frozen_parameters, self.trainable_parameters, checkpoint, per_gpu, refused, host, per_node
        )


def footprint(config: Config, llm_config: Path | None = None, meta: MetaModel | None = None) -> Footprint:
    """``config``'s model counted on meta and its step run there (the module docstring); ``meta``:
    that model already built (auto_fit.py prices many batch sizes of one model)."""
    precision = precision_of(config)
    compute = _compute_dtype(precision)
    frozen_dtype = _frozen_dtype(precision)
    trainable_dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    gather_frozen, gather_trainable = (compute, compute) if precision == "bf16-mixed" else (frozen_dtype, trainable_dtype)
    meta = meta or meta_model(config, llm_config)
    frozen = _numel(meta.model, False, set())
    trainable = _numel(meta.model, True, set())
    largest = max((p.numel() for p in meta.model.llm.parameters() if not p.requires_grad), default=0)
    towers = frozen - _numel(meta.model.llm, False, set())
    try:
        all_gather, fsdp_refused = gathered_bytes(meta.model, gather_frozen, gather_trainable), None
    except ModelLoadError as err:  # no decoder layers to shard: fsdp refuses this model, ddp's figures stand
        all_gather, fsdp_refused = 0, str(err)
    activations, logits = step_peak(meta, config, compute)
    return Footprint(
        precision,
        frozen,
        trainable,
        _bytes(frozen, frozen_dtype),
        _bytes(trainable, trainable_dtype),
        all_gather,
        activations,
        logits,
        largest_frozen_bytes=_bytes(largest, frozen_dtype),
        tower_frozen_parameters=towers,
        bucket_copy=not config.distributed.gradient_as_bucket_view,
        accumulates=config.trainer.accumulate_grad_batches > 1,
        fsdp_refused=fsdp_refused,
    )


def estimate(config: Config, gpus: int, llm_config: Path | None = None, gpus_per_node: int | None = None) -> Estimate:
    """Per-GPU bytes of ``config`` on ``gpus`` GPUs under each strategy, and host bytes per node of
    ``gpus_per_node`` ranks (default: 8, or fewer GPUs in all) (the module docstring)."""
    from purrsight.global_batch import resolve_global_batch

    # trainer.global_batch_size sets the accumulation for the world: whether gradients accumulate
    # (a window's whole fp32 gradients under fsdp) depends on it.
    config, _ = resolve_global_batch(config, gpus)
    return footprint(config, llm_config).estimate(gpus, gpus_per_node)
