"""The fingerprint of a model's frozen sources: a checkpoint carries it, and a resume refuses a
checkpoint trained on other frozen weights (module.py's ``verify_checkpoint``).

Version 4 (this one) hashes every byte of every frozen weight, and no rank reads more to do it:

- every row of every frozen tensor (a 1-d tensor's elements; a 0-d one whole) is hashed with its
  tensor's name and its row number, and the row hashes are summed modulo 2**256, so the sum does
  not depend on which rank hashed which row, nor in what order;
- each rank hashes its share of the rows, torch.chunk's split of dim 0 as FSDP2 shards it
  (``row_share``), and the ranks' sums are added (``FingerprintParts.combined``);
- an LLM from a directory of safetensors counts by its files' bytes (their dtype, whatever dtype
  the run holds the weights in): under ``distributed.strategy: fsdp`` from the rows each rank
  reads for its shard anyway (fsdp.py's ``fill``), built whole from the rows just loaded, in the
  file's dtype (a float32 copy of bf16 rows narrows back exactly); only where the run holds them
  narrower than the file (a float32 file in a bf16 run) are the rank's rows read again;
- everything else frozen (the encoders, the aligner, an LLM built from a config dict or read from
  pytorch_model.bin) counts by its float32 values before the run casts it;
- every tensor's name, dtype and shape (the files' headers for an LLM from files) and each frozen
  source's kind and architecture are hashed beside the sum.

The same weights give the same fingerprint however they are split over files, wherever the folder
lies, whether the model is built whole or sharded, on any number of ranks, in float32 or bf16.
Hashing costs about a second a GB of a rank's share (sha256 in C; bench/results/model.md).

Version 3 (``fingerprint_v3``: each tensor's key, dtype, shape and 256 bytes of it, the memory's
by a strided sample of 4096 values) missed an edit of most of a tensor's rows; it is computed at
every start beside version 4 (it reads about 16 KiB a tensor), to check the checkpoints it signed.
Version 2 is computed only for a checkpoint that carries it (model_builder.py's ``fingerprint_v2``).
Version 1 (no version in the checkpoint) hashed absolute model paths and cannot be recomputed:
accepted with a warning.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch

from purrsight.distributed.process_group import pickles
from purrsight.model.weight_files import DTYPES, WeightFiles, file_key

FINGERPRINT_VERSION = 4
ROW_SUM_MODULUS = 1 << 256
MEMORY_SAMPLE_VALUES = 4096  # version 3's sample of a tensor held in memory


def counts_by_memory(name: str, llm_from_files: bool) -> bool:
    """Whether the state-dict entry ``name`` is fingerprinted from memory: frozen, and not the LLM's
    when its weight files are fingerprinted instead (LoRA and the projectors train)."""
    if "lora_" in name or name.startswith("projectors."):
        return False
    return not (llm_from_files and name.startswith("llm."))


def row_share(rows: int, rank: int, world: int) -> tuple[int, int]:
    """The rows ``start:stop`` of a tensor of ``rows`` rows that ``rank`` of ``world`` hashes:
    torch.chunk's split, the one FSDP2 shards dim 0 by (fsdp.py's ``_rows_held``)."""
    chunk = math.ceil(rows / world)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def row_hash_sum(name: str, rows: torch.Tensor, first: int) -> int:
    """The sum modulo 2**256 of sha256(name, row number, row bytes) over ``rows``, whose first row is
    row ``first`` of the tensor ``name`` (a 0-d tensor is one row, a 1-d one's elements are rows)."""
    data = rows.detach().cpu().contiguous()
    if data.numel() == 0:
        return 0
    raw = data.reshape(data.shape[0] if data.dim() else 1, -1).view(torch.uint8).numpy()
    total = 0
    for number, row in enumerate(raw, start=first):
        digest = hashlib.sha256(f"{name}:{number}:".encode())
        digest.update(row)
        total += int.from_bytes(digest.digest(), "big")
    return total % ROW_SUM_MODULUS


@dataclass
class FingerprintParts:
    """Version 4 on one rank: the layout (the same on every rank), this rank's place among the ranks
    that share the hashing, and its sum of row hashes."""

    layout: str
    rank: int = 0
    world: int = 1
    rows: int = 0
    error: BaseException | None = None  # what stopped this rank's reading: raised on every rank by ``combined``

    def add_share(self, name: str, rows: torch.Tensor, total: int, start: int = 0, dtype: torch.dtype | None = None) -> None:
        """Hash the rows of ``rows`` (rows ``start:`` of the tensor ``name`` of ``total`` rows) that
        fall in this rank's share, as ``dtype`` (None: as they are)."""
        held = rows.reshape(1) if rows.dim() == 0 else rows
        first, last = row_share(total, self.rank, self.world)
        first, last = max(first, start), min(last, start + held.shape[0])
        if first < last:
            mine = held[first - start : last - start]
            self.rows = (self.rows + row_hash_sum(name, mine if dtype is None else mine.to(dtype), first)) % ROW_SUM_MODULUS

    def combined(self, group: Any = None) -> str:
        """The fingerprint: every rank of ``group`` adds its sum (all must call); None: this rank's alone.
        A rank's ``error`` is raised on every rank, so none waits for a sum that never comes."""
        outcomes: list[Any] = [(self.rows, self.error)]
        if group is not None:
            import torch.distributed as dist

            mine = self.error if self.error is None or pickles(self.error) else RuntimeError(f"rank {self.rank}: {self.error}")
            outcomes = [None] * dist.get_world_size(group)
            dist.all_gather_object(outcomes, (self.rows, mine), group=group)
        if self.error is not None:
            raise self.error
        for _, error in outcomes:
            if error is not None:
                raise error
        total = sum(rows for rows, _ in outcomes) % ROW_SUM_MODULUS
        return hashlib.sha256(f"v{FINGERPRINT_VERSION}|{self.layout}|{total:064x}".encode()).hexdigest()


def rows_of(tensor: torch.Tensor) -> int:
    return tensor.shape[0] if tensor.dim() else 1


def _rank_and_world(group: Any) -> tuple[int, int]:
    if group is None:
        return 0, 1
    import torch.distributed as dist

    return dist.get_rank(group), dist.get_world_size(group)


def fingerprint_parts(
    model: torch.nn.Module,
    sources: list[str],
    llm_files: WeightFiles | None,
    llm_keys: dict[str, str] | None,
    group: Any = None,
    llm_on_meta: bool = False,
) -> FingerprintParts:
    """This rank's part of version 4, before the frozen weights are cast. ``llm_files``: the LLM's
    weight files when it comes from a directory of safetensors; ``llm_keys``: its parameters'
    keys there (model/weight_files.py's ``weight_keys``), None where transformers makes some of
    them from several tensors (then each rank reads its share of every tensor of the files);
    ``llm_on_meta``: the LLM is on the meta device, and each rank adds the rows it reads (fsdp.py's
    ``fill``). ``group``: the ranks that share the hashing (None: this process hashes everything).
    What stops a rank's reading is kept in the parts, for ``combined`` to raise on every rank."""
    rank, world = _rank_and_world(group)
    layout = hashlib.sha256("|".join(sources).encode())
    if llm_files is not None:
        for key in sorted(llm_files.weight_map):
            stored = llm_files.stored(key)
            layout.update(f"{key}:{stored.dtype}:{list(stored.shape)};".encode())
    in_memory = [(n, t) for n, t in model.state_dict().items() if counts_by_memory(n, llm_files is not None)]
    for name, tensor in in_memory:
        layout.update(f"{name}:{list(tensor.shape)};".encode())
    parts = FingerprintParts(layout.hexdigest(), rank, world)
    try:
        for name, tensor in in_memory:
            if tensor.device.type == "meta":
                raise AssertionError(f"{name} is on the meta device: only an LLM read from its files may be")
            parts.add_share(name, tensor.detach(), rows_of(tensor), dtype=torch.float32)
        if llm_files is not None and not llm_on_meta:
            if llm_keys is not None:
                _add_llm_rows(parts, model, llm_files, llm_keys)
            else:
                _add_file_rows(parts, llm_files)
    except Exception as error:  # raised on every rank by combined
        parts.error = error
    return parts


def _add_file_rows(parts: FingerprintParts, files: WeightFiles) -> None:
    """This rank's share of every tensor of the files, read: the LLM's parameters are made from
    them by a conversion, so memory holds no row of the files as it lies there."""
    for key in sorted(files.weight_map):
        stored = files.stored(key)
        total = stored.shape[0] if stored.shape else 1
        start, stop = row_share(total, parts.rank, parts.world)
        parts.add_share(key, files.rows(key, start, stop), total, start)


def _add_llm_rows(parts: FingerprintParts, model: torch.nn.Module, files: WeightFiles, keys: dict[str, str]) -> None:
    """This rank's share of each file tensor the built LLM holds, from memory in the file's dtype."""
    done: set[str] = set()
    for name, param in model.named_parameters():
        key = keys.get(file_key(name))
        if not name.startswith("llm.") or "lora_" in name or key is None or key in done:
            continue
        done.add(key)  # a tied head: its embeddings' rows once
        stored = files.stored(key)
        dtype, total = DTYPES[stored.dtype], stored.shape[0] if stored.shape else 1
        held = param.detach()
        widened = held.dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16)  # exact both ways
        if tuple(held.shape) == stored.shape and (held.dtype == dtype or widened):
            parts.add_share(key, held, total, dtype=dtype)
        else:  # held narrower than the file: this rank's rows are read again
            start, stop = row_share(total, parts.rank, parts.world)
            parts.add_share(key, files.rows(key, start, stop), total, start)


def fingerprint_v3(model: torch.nn.Module, sources: list[str], llm_files: WeightFiles | None) -> str:
    """Version 3's fingerprint of ``model``'s frozen weights, before they are cast: a fixed sample
    of each tensor (``WeightFiles.sample_digest`` for an LLM from files, else a strided sample of
    up to MEMORY_SAMPLE_VALUES values), to check the checkpoints version 3 signed."""
    digest = hashlib.sha256(f"v3|{'|'.join(sources)}|".encode())
    if llm_files is not None:
        digest.update(llm_files.sample_digest().encode())
    memory = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        if not counts_by_memory(name, llm_from_files=llm_files is not None):
            continue
        if tensor.device.type == "meta":
            raise AssertionError(f"{name} is on the meta device: only an LLM read from its files may be")
        step = max(1, tensor.numel() // MEMORY_SAMPLE_VALUES)
        memory.update(f"{name}:{list(tensor.shape)}".encode())
        memory.update(tensor.detach().reshape(-1)[::step].to(torch.float32).cpu().numpy().tobytes())
    digest.update(memory.hexdigest().encode())
    return digest.hexdigest()
