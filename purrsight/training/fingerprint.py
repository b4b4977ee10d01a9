"""The fingerprint of a model's frozen sources: a checkpoint carries it, and a resume refuses a
checkpoint trained on other frozen weights (module.py's ``verify_checkpoint``).

Version 3 (this one) costs a start about nothing and reads nothing a rank does not read anyway:

- an LLM from a directory counts by its weight files: every tensor's key, dtype and shape from
  the files' headers, and a fixed sample of its bytes (model/weight_files.py: four 64-byte
  windows, about 16 KiB of storage a tensor, 0.5% of Qwen2.5-0.5B). Under ``distributed.strategy:
  fsdp`` rank 0 alone reads it and broadcasts the result (model_builder.py);
- everything held in memory when the model is built (the encoders, the aligner, an LLM built from
  a config dict) counts by a strided sample of up to 4096 values a tensor, as version 2 did: those
  weights are in every rank's memory already, so the sample reads no file.

The same weights give the same fingerprint however they are split over files, wherever the folder
lies, and whether the model is built whole or sharded, in float32 or bf16.

Version 2 sampled every frozen tensor by strided rows, the LLM's from its files under fsdp: on every
rank at every start that read 30-47% of a Qwen2.5 base. It is computed only to check a checkpoint
that carries it (model_builder.py's ``fingerprint_v2``). Version 1 (no version in the checkpoint)
hashed absolute model paths and cannot be recomputed: accepted with a warning.
"""

from __future__ import annotations

import hashlib

import torch

from purrsight.model.weight_files import WeightFiles

FINGERPRINT_VERSION = 3
MEMORY_SAMPLE_VALUES = 4096  # per tensor held in memory: changes when weights are swapped or re-initialised


def counts_by_memory(name: str, llm_from_files: bool) -> bool:
    """Whether the state-dict entry ``name`` is fingerprinted from memory: frozen, and not the LLM's
    when its weight files are fingerprinted instead (LoRA and the projectors train)."""
    if "lora_" in name or name.startswith("projectors."):
        return False
    return not (llm_from_files and name.startswith("llm."))


def memory_digest(model: torch.nn.Module, llm_from_files: bool) -> str:
    """sha256 of each frozen tensor held in memory: its name, shape and a strided sample."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        if not counts_by_memory(name, llm_from_files):
            continue
        if tensor.device.type == "meta":
            raise AssertionError(f"{name} is on the meta device: only an LLM read from its files may be")
        step = max(1, tensor.numel() // MEMORY_SAMPLE_VALUES)
        digest.update(f"{name}:{list(tensor.shape)}".encode())
        digest.update(tensor.detach().reshape(-1)[::step].to(torch.float32).cpu().numpy().tobytes())
    return digest.hexdigest()


def frozen_fingerprint(model: torch.nn.Module, sources: list[str], llm_files: WeightFiles | None) -> str:
    """Version 3's fingerprint of ``model``'s frozen weights, before they are cast (a bf16 run and a
    float32 run of the same weights resume each other). ``sources`` names each frozen source's kind
    and architecture; ``llm_files``: the LLM's weight files when it comes from a directory."""
    digest = hashlib.sha256(f"v{FINGERPRINT_VERSION}|{'|'.join(sources)}|".encode())
    if llm_files is not None:
        digest.update(llm_files.sample_digest().encode())
    digest.update(memory_digest(model, llm_from_files=llm_files is not None).encode())
    return digest.hexdigest()
