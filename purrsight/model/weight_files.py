"""A Hugging Face model directory's safetensors, read a slice at a time.

A base larger than one GPU never exists whole in one process: under ``distributed.strategy:
fsdp`` each rank reads only the rows of each frozen tensor its shard holds (safetensors maps
the file and reads just those bytes), one tensor at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from purrsight.model.loading import ModelLoadError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def file_key(name: str) -> str:
    """The weight file's key of an LLM parameter of the assembled model: peft's wrapping taken out of its name."""
    return name.split("llm.base_model.model.", 1)[-1].replace(".base_layer.", ".")


class WeightFiles:
    """The tensors of a directory's ``model.safetensors`` (or its sharded files), by key."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.folder / SINGLE_FILE).is_file():
            from safetensors import safe_open

            with safe_open(str(self.folder / SINGLE_FILE), framework="pt") as handle:
                weight_map = dict.fromkeys(handle.keys(), SINGLE_FILE)
        else:
            raise ModelLoadError(f"{self.folder}: no {SINGLE_FILE} or {INDEX_FILE} (a sharded base loads from safetensors only)")
        self.weight_map = weight_map

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    @contextmanager
    def _slice(self, key: str) -> Iterator[Any]:
        """The tensor's lazy slice. Its file is mapped for this read only: pages a rank read
        stay counted in its RSS while the file is mapped, so a file is never kept open."""
        from safetensors import safe_open

        with safe_open(str(self.folder / self.weight_map[key]), framework="pt") as handle:
            yield handle.get_slice(key)

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the tensor (the whole of a 0-d or 1-d tensor's range)."""
        with self._slice(key) as tensor:
            return tensor[start:stop].clone()

    def strided_sample(self, key: str, step: int) -> torch.Tensor:
        """``tensor.reshape(-1)[::step]``, reading each row that holds one of those values once."""
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
