"""A data set of sample ids, for loaders whose workers must start fast: this module imports torch
alone, so a worker that unpickles it imports nothing else (tests/simulated_ranks.py)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class SampleIds(Dataset[int]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def collate_ids(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)
