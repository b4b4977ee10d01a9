"""The causal LM with LoRA adapters, and its tokenizer.

A local directory (``from_pretrained(..., local_files_only=True)``) is the real path;
a Qwen2 config dict builds a tiny random-initialised LM with a fixed seed. Either way
the base weights are frozen and only the LoRA adapters train.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Qwen2Config

from purrsight.model.loading import ModelLoadError, architecture_digest
from purrsight.model.meta_init import parameters_on_meta
from purrsight.model.weight_files import holds_safetensors


def load_tokenizer(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"{path}: tokenizer directory does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({err})") from None
    if tokenizer.pad_token_id is None:  # many base LMs ship without one; eos is the convention
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _linear_names(model: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}


def check_lora_targets(base: nn.Module, targets: list[str]) -> None:
    """Refuse LoRA ``targets`` that name none, or not only, of ``base``'s linear layers (peft's own
    errors are a traceback); the estimate checks them as training does."""
    available = ", ".join(sorted(_linear_names(base)))
    if not targets:
        raise ModelLoadError(f"LoRA target_modules is empty: name at least one of the LLM's linear layers: {available}")
    missing = sorted(set(targets) - _linear_names(base))
    if missing:
        raise ModelLoadError(f"LoRA target_modules: {', '.join(missing)} not found in the LLM; its linear layers are: {available}")


def _base_llm(
    vocab_size: int,
    seed: int,
    path: str | None,
    config: dict[str, Any] | None,
    attn_implementation: str,
    on_meta: bool,
    dtype: torch.dtype = torch.float32,
) -> tuple[PreTrainedModel, str]:
    if path is not None:
        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"{folder}: not a Hugging Face model directory (no config.json)")
        try:
            if on_meta:  # shapes only: the weights are read later, each rank its own rows (training/fsdp.py)
                hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
                with parameters_on_meta():
                    model = AutoModelForCausalLM.from_config(
                        hf_config, attn_implementation=attn_implementation, dtype=torch.float32
                    )
                return model, f"dir:{architecture_digest(model.config.to_dict())}"
            # Read straight into the dtype the frozen weights are held in (bf16 under bf16 precision):
            # transformers converts tensor by tensor, so no rank ever holds a float32 copy of the
            # base (30 GB of host memory a rank at 7B, before 2026-11-28). A base of
            # pytorch_model.bin is fingerprinted from memory before the cast, so it is read in
            # float32 as before: a bf16 and a float32 run of it must agree (training/fingerprint.py).
            load_dtype = dtype if holds_safetensors(folder) else torch.float32
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)  # weights missing from the folder: same on every rank
                model = AutoModelForCausalLM.from_pretrained(
                    folder, local_files_only=True, attn_implementation=attn_implementation, dtype=load_dtype
                )
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"{folder}: cannot load the LLM ({err})") from None
        # The dtype it was read into is no part of the source: recorded as float32, as every build
        # recorded it before bf16 reads (2026-11-28), so earlier fingerprints still match.
        return model, f"dir:{architecture_digest({**model.config.to_dict(), 'dtype': 'float32'})}"
    options = {"vocab_size": vocab_size, **(config or {})}
    try:
        qwen2 = Qwen2Config(**options)
    except (TypeError, ValueError) as err:
        raise ModelLoadError(f"LLM config: {err}") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(qwen2, attn_implementation=attn_implementation)
    return model, f"qwen2-config:{architecture_digest(options)}:seed{seed}"


def recompute_layers(base: PreTrainedModel) -> None:
    """Gradient checkpointing of every decoder layer, non-reentrant (it works with frozen inputs and
    with DDP); through transformers' activation_checkpointing_enable where it has it (5.24: the
    older name warns at every build)."""
    enable = getattr(base, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_llm(
    vocab_size: int,
    seed: int,
    lora: LoraConfig,
    *,
    path: str | None = None,
    config: dict[str, Any] | None = None,
    gradient_checkpointing: bool = False,
    attn_implementation: str = "sdpa",
    on_meta: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[PeftModel, str]:
    """The LM wrapped with ``lora``, and a description of its frozen source for fingerprints.

    The LM comes from a local Hugging Face directory (``path``) or is random-initialised
    from a Qwen2 ``config`` dict (the tiny default), seeded so every rank builds the same.
    ``on_meta`` (a directory only): every parameter on the meta device, LoRA's included.
    ``dtype``: the frozen weights' dtype, which a directory's safetensors are read into (LoRA's
    adapters stay float32: peft keeps them so over a bf16 base).
    """
    base, source = _base_llm(vocab_size, seed, path, config, attn_implementation, on_meta and path is not None, dtype)
    check_lora_targets(base, list(lora.target_modules or []))
    if gradient_checkpointing:
        recompute_layers(base)
    base.config.use_cache = False  # no KV cache while training
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        model = get_peft_model(base, lora)
    if not on_meta:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_A." in name:
                    param.copy_(lora_a_init(name, param.shape, seed))
    return model, source


def leave_lora_casts_to_autocast(model: nn.Module, precision: str) -> int:
    """Under a mixed precision (Lightning's ``*-mixed``: autocast), stop peft casting each LoRA
    layer's input to its adapters' dtype; the number of layers switched (0 under any other).

    With the base in bf16 an adapter's input is bf16: peft copied it to float32 (the adapters'
    dtype) and autocast copied it straight back to bf16 for lora_A's matmul, two copies an adapter
    in the forward, two in checkpointing's recomputation and two of its gradient in backward
    (1,008 kernels a step at the 0.5B preset's architecture: bench/results/gpu.md, 2026-11-29).
    The matmuls see the same bf16 input either way; LoRA's dropout now runs on it in bf16 (on a
    GPU the fused kernel scales in float32; the CPU's rounds 1/(1-p) to bf16, 0.2% at p=0.05).
    Without autocast (32-true, bf16-true) the cast is what makes input and weights agree: kept.
    The switch is peft's own (``cast_input_dtype_enabled``, what ``peft.helpers.
    disable_input_dtype_casting`` sets; peft >= 0.15, requirements.txt asks 0.21)."""
    if not precision.endswith("-mixed"):
        return 0
    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    for layer in layers:
        layer.cast_input_dtype_enabled = False  # type: ignore[assignment]  # peft declares it in LoraLayer, untyped
    return len(layers)


def lora_a_init(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """A LoRA A matrix's initial value (peft's kaiming-uniform), from the seed and its name alone:
    the same on every rank, whether the model is built whole or sharded (training/fsdp.py)."""
    key = name.split("base_model.model.", 1)[-1]  # as peft names it, wherever the LLM sits
    generator = torch.Generator().manual_seed(int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:15], 16))
    # On the CPU, where the generator is, whatever default device the caller set: Lightning
    # builds the model under `torch.device("cuda")` on a GPU, and a CUDA tensor refuses a CPU
    # generator (every bf16 run on a GPU stopped here; caught by tests/gpu on an H200).
    value = torch.empty(shape, device="cpu")
    nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
    return value


def decoder_layers(llm: nn.Module) -> list[nn.Module]:
    """The LLM's decoder layers, found as the model declares them: the outermost modules of the
    classes its ``_no_split_modules`` names (what Hugging Face never splits across devices), which
    must be the whole of one ModuleList of ``num_hidden_layers`` (a declared class nested inside
    each layer, an attention alone, would leave the rest of every layer behind). Anything else
    stops with one line: a layer not found would stay in fsdp's root unit, gathered whole every
    step, and nothing else would say so. training/fsdp.py shards these; the estimate counts them."""
    base: nn.Module = llm.get_base_model() if isinstance(llm, PeftModel) else llm
    declared = set(getattr(base, "_no_split_modules", None) or ())
    layers: list[nn.Module] = []
    inside: list[str] = []  # the layers found so far, by name: a declared class nested in one is part of it
    for name, module in base.named_modules():
        # by the class and its bases: fully_shard swaps a unit's class for a subclass, FSDP<name>
        of_declared_class = any(cls.__name__ in declared for cls in type(module).__mro__)
        if of_declared_class and not any(name.startswith(f"{outer}.") for outer in inside):
            layers.append(module)
            inside.append(name)
    config: Any = getattr(base, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    expected = getattr(text, "num_hidden_layers", None)
    lists = [m for m in base.modules() if isinstance(m, nn.ModuleList) and len(m) == len(layers) and len(layers) > 0]
    one_list = any(all(a is b for a, b in zip(m, layers, strict=True)) for m in lists)
    named = f"its _no_split_modules {sorted(declared)} names {len(layers)} modules"
    if not declared:
        found = "it declares no _no_split_modules"
    elif len(layers) != expected:
        found = f"{named} and config.num_hidden_layers is {expected}"
    elif not one_list:
        found = (
            f"{named}, each a {type(layers[0]).__name__}, not the children of one ModuleList "
            "(the rest of each layer would stay in the root unit)"
        )
    else:
        return layers
    raise ModelLoadError(
        f"distributed.strategy=fsdp finds no decoder layers to shard one by one in {type(base).__name__}: {found} "
        "(without them every step gathers the whole base); use distributed.strategy=ddp for this model"
    )
