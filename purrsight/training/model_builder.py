"""Build the Phase 2 model described by a config, and fingerprint its frozen sources."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from peft import LoraConfig

from purrsight.config import Config
from purrsight.datasets.builder import build_decoders
from purrsight.distributed.process_group import computed_on_rank_zero
from purrsight.internals.transformers_keys import loaded_names
from purrsight.model.aligner import load_aligner
from purrsight.model.encoders import FrozenEncoder, load_encoder
from purrsight.model.linear_cross_entropy import compiled_scorer, use_scorer
from purrsight.model.llm import load_llm, load_tokenizer
from purrsight.model.loading import ModelLoadError
from purrsight.model.multimodal import MODALITIES, PurrSightModel
from purrsight.model.weight_files import WeightFiles, file_key, holds_safetensors, weight_keys
from purrsight.training.fingerprint import FINGERPRINT_VERSION, FingerprintParts, fingerprint_parts, fingerprint_v3


@dataclass
class BuiltModel:
    model: PurrSightModel
    tokenizer: Any
    fingerprint: str  # of FINGERPRINT_VERSION; "" while the rows of an LLM on meta are still to be read
    earlier_fingerprints: dict[int, str] = field(default_factory=dict)  # version 3's, to check its checkpoints
    fingerprint_parts: FingerprintParts | None = None  # version 4 before its rows are summed (fsdp.py)


def _tensor_sample_digest(model: torch.nn.Module, files: WeightFiles | None = None, keys: dict[str, str] | None = None) -> str:
    """Hash names, shapes and a strided sample of every frozen tensor (fingerprint version 2, kept
    to check the checkpoints it signed: training/fingerprint.py).

    Hashing every byte of a 7B model would add a minute to each start; a strided sample
    of up to 4096 values per tensor still changes when weights are swapped or re-initialised.
    A tensor still on the meta device is sampled from its weight file (``files``, under the key
    ``keys`` gives its LLM name), so a sharded build has the same fingerprint as a whole one.
    """
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        if "lora_" in name or name.startswith("projectors."):
            continue
        step = max(1, tensor.numel() // 4096)
        if tensor.device.type == "meta":
            assert files is not None and keys is not None, name
            sample = files.strided_sample(keys[file_key(name)], step)  # a tied head: the embeddings' key
        else:
            sample = tensor.detach().reshape(-1)[::step]
        digest.update(f"{name}:{list(tensor.shape)}".encode())
        digest.update(sample.to(torch.float32).cpu().numpy().tobytes())
    return digest.hexdigest()


def frozen_dtype(precision: str) -> torch.dtype:
    """The dtype frozen weights are held in under a Lightning precision: bf16 under bf16
    ("bf16-mixed", "bf16-true"), where every matmul runs in bf16 anyway; float32 otherwise
    (fp16's range is too narrow to hold weights a model was not trained in)."""
    return torch.bfloat16 if precision.startswith("bf16") else torch.float32


def hold_frozen_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Store the frozen parameters in ``dtype``; trainable ones (and so their gradients and
    optimizer state) stay float32. Buffers keep theirs: rotary frequencies and the pixel
    scaling lose precision in bf16 and are tiny."""
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def compile_trainable_path(model: PurrSightModel, shapes: int | None = None, cuda_graphs: bool = False) -> int:
    """torch.compile, in place, what trains: each decoder layer of the LLM with its LoRA adapters,
    each modality's projector and the loss's chunk scorer; the number of decoder layers compiled.

    Per layer, as torchtitan does: the layers share their code, so one compilation serves them
    all, and a graph break in one costs little. ``nn.Module.compile`` keeps parameter names, so
    checkpoints are the same with and without. The frozen towers stay eager: they run once per
    sample, on a batch whose size varies with the samples that hold their modality. The loss's
    chunks: model/linear_cross_entropy.py's ``compiled_scorer``.

    ``shapes``: how many input shapes the batches can take (``data.pad_to_multiple_of`` pads them
    to a few lengths): each is compiled statically (no symbolic shapes, which a second length's
    recompilation crashed in inductor on torch 2.11: bench/results/gpu.md), and dynamo's
    recompile limit (8) is raised to hold them all. None: dynamic shapes after the first
    recompilation, torch's default.

    ``cuda_graphs`` (static ``shapes`` only): the layers compile in ``reduce-overhead`` mode, each
    shape's kernels recorded once as a CUDA graph and replayed with one launch (inductor records
    none for CPU tensors). The projectors and the loss keep the default mode: a projector is a few
    kernels, not worth a graph's memory pool, and the loss's row count changes with the labels,
    each new count a new recording.
    """
    base = model.llm.get_base_model()
    layers = getattr(getattr(base, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ModelLoadError(f"trainer.compile: {type(base).__name__} has no model.layers to compile; set trainer.compile=false")
    if shapes is not None:
        import torch._dynamo.config as dynamo

        dynamo.recompile_limit = max(dynamo.recompile_limit, shapes)
    mode = "reduce-overhead" if cuda_graphs and shapes is not None else None
    for layer in layers:
        layer.compile(dynamic=False if shapes is not None else None, mode=mode)
    for projector in model.projectors.values():
        projector.compile()  # a micro-batch's samples x its tokens: one shape but a last batch's
    use_scorer(model.head, compiled_scorer())
    return len(layers)


def padded_shapes(config: Config) -> int | None:
    """At most how many compilations a decoder layer needs with ``data.pad_to_multiple_of`` (None
    without it): one per length (its multiples up to ``data.max_length``, and that length) for each
    kind of batch dynamo tells apart: training's, with gradients, and validation's, without (a
    guard on the grad mode), each in full and as a last, shorter batch."""
    multiple = config.data.pad_to_multiple_of
    return None if multiple is None else 4 * (-(-config.data.max_length // multiple) + 1)


def build_model(
    config: Config,
    frozen: torch.dtype = torch.float32,
    llm_on_meta: bool = False,
    fingerprint_group: Any = None,
    fingerprint_version: int = FINGERPRINT_VERSION,
) -> BuiltModel:
    """The model of ``config``; its frozen weights held in ``frozen`` (see frozen_dtype).

    ``llm_on_meta`` (an LLM from a directory): the LLM's parameters are left on the meta
    device, to be sharded and then filled from its weight files (training/fsdp.py).
    ``fingerprint_group``: a process group whose ranks all build at once (every rank of the run):
    each hashes its share of the frozen rows and the sums are added; rank 0 alone computes
    version 3 and broadcasts it. None: this process hashes everything. ``fingerprint_version`` 2:
    the fingerprint an earlier PurrSight gave (``fingerprint_v2``), else training/fingerprint.py's.
    """
    seed = config.run.seed
    tokenizer = load_tokenizer(config.tokenizer_dir())
    llm_cfg = config.model.llm
    lora = LoraConfig(
        r=llm_cfg.lora.r,
        lora_alpha=llm_cfg.lora.alpha,  # type: ignore[arg-type]  # peft annotates int; a float alpha works (scale alpha / r)
        lora_dropout=llm_cfg.lora.dropout,
        target_modules=list(llm_cfg.lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    llm, llm_source = load_llm(
        len(tokenizer),
        seed,
        lora,
        path=llm_cfg.path,
        config=llm_cfg.config,
        gradient_checkpointing=llm_cfg.checkpointing,
        attn_implementation=llm_cfg.attn_implementation,
        on_meta=llm_on_meta,
        dtype=frozen,
    )
    encoders: dict[str, FrozenEncoder] = {}
    sources = [llm_source]
    for offset, modality in enumerate(MODALITIES, start=2):
        cfg = getattr(config.model, f"{modality}_encoder")
        if not cfg.enabled:
            continue
        loaded = load_encoder(modality, seed + offset, path=cfg.path, config=cfg.config, model_type=cfg.model_type)  # type: ignore[arg-type]
        encoders[modality] = loaded.encoder
        sources.append(loaded.source)
    aligner = None
    if config.model.aligner_checkpoint is not None:
        widths = {name: enc.width for name, enc in encoders.items()}
        aligner = load_aligner(config.model.aligner_checkpoint, widths, config.model.aligner_dim)
        sources.append("aligner")  # its weights are in the tensor digest; its path is not identity
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 10)  # projector init: identical on every rank and restart
        image_decoder = build_decoders(config)[0] if "image" in encoders else None
        pixel_scaling = image_decoder.pixel_scaling if image_decoder is not None else None  # the model normalises uint8 pictures
        model = PurrSightModel(
            llm,
            encoders,
            aligner,
            config.model.prefix_tokens,
            config.model.projector_hidden,
            pixel_scaling,
            attention=llm_cfg.attn_implementation,
            projector=config.model.projector,
        )
    # Before the cast: a bf16 run and a float32 run of the same weights may resume each other.
    path = llm_cfg.path
    if fingerprint_version == 2:
        files = WeightFiles(path) if llm_on_meta and path is not None else None
        keys = weight_keys(llm.get_base_model(), files, loaded_names) if files is not None else None
        fingerprint = hashlib.sha256(("|".join(sources) + _tensor_sample_digest(model, files, keys)).encode()).hexdigest()
        hold_frozen_in(model, frozen)
        return BuiltModel(model, tokenizer, fingerprint)
    # A base of pytorch_model.bin, built whole, is counted from memory (as a config-dict LLM is);
    # only the sharded build (on meta) needs safetensors, and load_llm refused it without them.
    from_files = WeightFiles(path) if path is not None and (llm_on_meta or holds_safetensors(path)) else None
    v3 = computed_on_rank_zero(lambda: fingerprint_v3(model, sources, from_files), fingerprint_group)
    keys = None if from_files is None or llm_on_meta else llm_weight_keys(llm, from_files)
    parts = fingerprint_parts(model, sources, from_files, keys, fingerprint_group, llm_on_meta)
    hold_frozen_in(model, frozen)
    if llm_on_meta and from_files is not None:  # each rank adds the rows it reads for its shard (fsdp.py)
        return BuiltModel(model, tokenizer, "", {3: v3}, parts)
    return BuiltModel(model, tokenizer, parts.combined(fingerprint_group), {3: v3})


def llm_weight_keys(llm: Any, files: WeightFiles) -> dict[str, str] | None:
    """The LLM's parameters' keys in its weight files, or None where transformers makes a parameter
    from several tensors (a ddp build loads those; their rows are not the files')."""
    try:
        return weight_keys(llm.get_base_model(), files, loaded_names)
    except ModelLoadError:
        return None


def fingerprint_v2(config: Config) -> str:
    """The fingerprint version 2 gave ``config``'s frozen sources, to check a checkpoint it signed.

    The model is built again, its LLM on the meta device when it comes from a directory of
    safetensors (version 2 sampled it from its files then, and the same values from memory when
    built whole, as a base of pytorch_model.bin always was): this costs what every start cost
    before version 3, once, for the resume of such a checkpoint.
    """
    path = config.model.llm.path
    return build_model(config, llm_on_meta=path is not None and holds_safetensors(path), fingerprint_version=2).fingerprint
