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
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, Qwen2Config

from purrsight.model.loading import ModelLoadError, architecture_digest
from purrsight.model.meta_init import parameters_on_meta


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
    vocab_size: int, seed: int, path: str | None, config: dict[str, Any] | None, attn_implementation: str, on_meta: bool
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
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)  # weights missing from the folder: same on every rank
                model = AutoModelForCausalLM.from_pretrained(
                    folder, local_files_only=True, attn_implementation=attn_implementation, dtype=torch.float32
                )
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"{folder}: cannot load the LLM ({err})") from None
        return model, f"dir:{architecture_digest(model.config.to_dict())}"
    options = {"vocab_size": vocab_size, **(config or {})}
    try:
        qwen2 = Qwen2Config(**options)
    except (TypeError, ValueError) as err:
        raise ModelLoadError(f"LLM config: {err}") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(qwen2, attn_implementation=attn_implementation)
    return model, f"qwen2-config:{architecture_digest(options)}:seed{seed}"


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
) -> tuple[PeftModel, str]:
    """The LM wrapped with ``lora``, and a description of its frozen source for fingerprints.

    The LM comes from a local Hugging Face directory (``path``) or is random-initialised
    from a Qwen2 ``config`` dict (the tiny default), seeded so every rank builds the same.
    ``on_meta`` (a directory only): every parameter on the meta device, LoRA's included.
    """
    base, source = _base_llm(vocab_size, seed, path, config, attn_implementation, on_meta and path is not None)
    check_lora_targets(base, list(lora.target_modules or []))
    if gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs and with DDP.
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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
