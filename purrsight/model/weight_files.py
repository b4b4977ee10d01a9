"""A Hugging Face model directory's safetensors, read a slice at a time.

A base larger than one GPU never exists whole in one process: under ``distributed.strategy:
fsdp`` each rank reads only the rows of each frozen tensor its shard holds, one tensor at a
time. Reads are exact: the byte range from each file's header, read with ``pread`` and the
kernel's read-ahead off for the file (``POSIX_FADV_RANDOM``) and asked for that range alone
(``POSIX_FADV_WILLNEED``). Through a memory map (safetensors' own slices) every page fault
read the kernel's read-ahead window around it, 128 KiB to 8 MiB, which on a 0.5B base made each
of two ranks read the whole base instead of its half (bench/results/model.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from purrsight.model.loading import ModelLoadError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors' dtype names -> torch's
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
# The fixed sample of each tensor the fingerprint hashes (training/model_builder.py): a window at
# its start, its end and two between. A page or two of storage each, so about 16 KiB a tensor:
# 5 MB for Qwen2.5-0.5B's 290 tensors (0.5% of it), 15 MB for 72B's 963 (0.01%).
SAMPLE_WINDOWS = 4
SAMPLE_WINDOW_BYTES = 64


def file_key(name: str) -> str:
    """The LLM's own name of a parameter of the assembled model: peft's wrapping taken out of its name
    (the weight file's key where the model renames nothing; ``weight_keys`` maps it where it does)."""
    return name.split("llm.base_model.model.", 1)[-1].replace(".base_layer.", ".")


# file keys, the LLM and its parameter names -> each key's name in the LLM and whether a converter makes it
LoadedNames = Callable[[nn.Module, Iterable[str], Iterable[str]], dict[str, tuple[str, bool]]]


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies in its file, as the file's header says."""

    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets in the file
    end: int


@contextmanager
def exact_reads(path: Path) -> Iterator[int]:
    """A descriptor of ``path`` whose reads fetch what they ask for and nothing around it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        yield fd
    finally:
        os.close(fd)


def read_at(fd: int, offset: int, size: int, path: Path) -> torch.Tensor:
    """``size`` bytes of ``path`` (open as ``fd``) from ``offset``, read straight into a uint8 tensor."""
    buffer = torch.empty(size, dtype=torch.uint8)
    view = buffer.numpy().data  # the tensor's own memory
    done = 0
    while done < size:  # one read returns at most about 2 GiB
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            raise ModelLoadError(f"{path}: the file ends {size - done} bytes short of what its header says it holds")
        done += count
    return buffer


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors a safetensors file holds (its first 8 bytes give the JSON header's length)."""
    with exact_reads(path) as fd:
        first = os.pread(fd, 8, 0)
        length = struct.unpack("<Q", first)[0] if len(first) == 8 else -1
        if not 0 < length <= os.fstat(fd).st_size - 8:
            raise ModelLoadError(f"{path}: not a safetensors file (no header length in its first 8 bytes)")
        try:
            header = json.loads(read_at(fd, 8, length, path).numpy().tobytes())
        except ValueError:
            raise ModelLoadError(f"{path}: not a safetensors file (its header does not parse)") from None
    start = 8 + length
    return {
        key: StoredTensor(entry["dtype"], tuple(entry["shape"]), start + entry["data_offsets"][0], start + entry["data_offsets"][1])
        for key, entry in header.items()
        if key != "__metadata__"
    }


def sample_offsets(stored: StoredTensor) -> list[tuple[int, int]]:
    """(offset, size) of the tensor's fixed sample: SAMPLE_WINDOWS windows spread from its first
    byte to its last, or the whole tensor when it is no larger than they are."""
    size = stored.end - stored.begin
    if size <= SAMPLE_WINDOWS * SAMPLE_WINDOW_BYTES:
        return [(stored.begin, size)]
    last = size - SAMPLE_WINDOW_BYTES
    return [(stored.begin + last * i // (SAMPLE_WINDOWS - 1), SAMPLE_WINDOW_BYTES) for i in range(SAMPLE_WINDOWS)]


def holds_safetensors(folder: str | Path) -> bool:
    """Whether ``folder`` holds its weights as safetensors (a base of ``pytorch_model.bin`` does not)."""
    return (Path(folder) / INDEX_FILE).is_file() or (Path(folder) / SINGLE_FILE).is_file()


class WeightFiles:
    """The tensors of a directory's ``model.safetensors`` (or its sharded files), by key."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        self._headers: dict[str, dict[str, StoredTensor]] = {}
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.folder / SINGLE_FILE).is_file():
            weight_map = dict.fromkeys(self._header(SINGLE_FILE), SINGLE_FILE)
        else:
            raise ModelLoadError(f"{self.folder}: no {SINGLE_FILE} or {INDEX_FILE} (a sharded base loads from safetensors only)")
        self.weight_map = weight_map

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def _header(self, file: str) -> dict[str, StoredTensor]:
        if file not in self._headers:
            self._headers[file] = read_header(self.folder / file)
        return self._headers[file]

    def stored(self, key: str) -> StoredTensor:
        file = self.weight_map[key]
        header = self._header(file)
        if key not in header:
            raise ModelLoadError(f"{self.folder / file}: no tensor {key}, which {INDEX_FILE} places there")
        return header[key]

    def sample_digest(self) -> str:
        """sha256 of every tensor's key, dtype, shape and fixed sample (``sample_offsets``), in
        key order: the files' headers and about 16 KiB a tensor are read, and how the tensors are
        split over files does not count."""
        samples: dict[str, bytes] = {}
        for file in sorted(set(self.weight_map.values())):
            with exact_reads(self.folder / file) as fd:
                for key in sorted(k for k, f in self.weight_map.items() if f == file):
                    windows = sample_offsets(self.stored(key))
                    samples[key] = b"".join(read_at(fd, at, size, self.folder / file).numpy().tobytes() for at, size in windows)
        digest = hashlib.sha256()
        for key in sorted(samples):
            stored = self.stored(key)
            digest.update(f"{key}:{stored.dtype}:{list(stored.shape)}:".encode())
            digest.update(samples[key])
        return digest.hexdigest()

    @contextmanager
    def _slice(self, key: str) -> Iterator[Any]:
        """The tensor's lazy slice, for ``strided_sample`` (version 2's fingerprint) only. Its file
        is mapped for this read only: pages a rank read stay counted in its RSS while the file is
        mapped, so a file is never kept open."""
        from safetensors import safe_open

        with safe_open(str(self.folder / self.weight_map[key]), framework="pt") as handle:
            yield handle.get_slice(key)

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the tensor (elements of a 1-d one; a 0-d one whole), reading
        those bytes and no others."""
        stored = self.stored(key)
        path = self.folder / self.weight_map[key]
        if stored.dtype not in DTYPES:
            raise ModelLoadError(f"{path}: tensor {key} has dtype {stored.dtype}, which torch cannot hold")
        dtype, shape = DTYPES[stored.dtype], stored.shape
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        start, stop = (0, 1) if not shape else (min(start, shape[0]), min(stop, shape[0]))
        offset, size = stored.begin + start * row_bytes, (stop - start) * row_bytes
        with exact_reads(path) as fd:
            if size:  # (a length of 0 would advise the rest of the file)
                os.posix_fadvise(fd, offset, size, os.POSIX_FADV_WILLNEED)  # the whole range at once, not page by page
            data = read_at(fd, offset, size, path)
        return data.view(dtype).reshape((stop - start, *shape[1:]) if shape else ())

    def strided_sample(self, key: str, step: int) -> torch.Tensor:
        """``tensor.reshape(-1)[::step]``, reading each row that holds one of those values once.

        Version 2's fingerprint, computed only to check a checkpoint it signed: it reads most of
        each tensor's pages (training/model_builder.py)."""
        with self._slice(key) as tensor:
            shape = list(tensor.get_shape())
            if len(shape) < 2:
                return tensor[:].reshape(-1)[::step].clone()
            row_length = 1
            for size in shape[1:]:
                row_length *= size
            indices = torch.arange(0, shape[0] * row_length, step)
            rows, columns = indices // row_length, indices % row_length
            return torch.cat([tensor[row : row + 1].reshape(-1)[columns[rows == row]] for row in rows.unique().tolist()])


def weight_keys(llm: nn.Module, files: WeightFiles, loaded_names: LoadedNames) -> dict[str, str]:
    """Each parameter of ``llm`` (the Hugging Face model, peft's adapters left out and its wrapping
    taken out of the names, as ``file_key`` gives them) -> the key of its tensor in ``files``.

    The keys are named as ``from_pretrained`` names them (``loaded_names``: the model's own
    conversion, where it renames). A tied parameter (a head sharing the embeddings) is found under
    any name of the one tensor, as the model ties them, whatever either is called. A parameter
    that no key holds, or that transformers converts from several tensors, is one line naming it.
    """
    aliases: dict[int, list[str]] = {}
    for name, param in llm.named_parameters(remove_duplicate=False):
        if ".lora_" not in name:
            aliases.setdefault(id(param), []).append(name.replace(".base_layer.", "."))
    names = [name for group in aliases.values() for name in group]
    loaded: dict[str, str] = {}
    converted: dict[str, str] = {}
    for key, (name, is_converted) in sorted(loaded_names(llm, files.weight_map, names).items()):
        if is_converted:
            converted.setdefault(name, key)  # the first of the tensors it is made from, for the message
        else:
            loaded[name] = key
    keys: dict[str, str] = {}
    for group in aliases.values():
        found = next((loaded[name] for name in group if name in loaded), None)
        for name in group:
            if found is not None:
                keys[name] = found
            elif name in converted:
                raise ModelLoadError(
                    f"{files.folder}: transformers makes the LLM's {name} from {converted[name]} and other tensors "
                    "(merged or split); distributed.strategy=fsdp reads each tensor's rows as they lie in the files: "
                    "use distributed.strategy=ddp for this model"
                )
            else:
                raise ModelLoadError(f"{files.folder}: no tensor in the weight files holds the LLM's {name}")
    return keys
