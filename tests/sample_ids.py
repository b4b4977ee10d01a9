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

    def lengths(self) -> list[int]:
        """Made-up lengths (1..40, ties included) for data.group_by_length: a fixed function of the id."""
        return [(index * 2654435761) % 40 + 1 for index in range(self.size)]


def collate_ids(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


class WorkerSettings(Dataset[dict]):
    """Decodes one picture with the decoder it was given, in whatever process it lands in, and
    reports that process's settings: what a loader worker really has (tests/unit/test_loader_workers.py)."""

    def __init__(self, decoder: object, picture: str, size: int) -> None:
        self.decoder = decoder
        self.picture = picture
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        import logging
        import os
        import signal
        import sys

        from PIL import Image

        error = ""
        try:
            self.decoder(self.picture)  # type: ignore[operator]
        except Exception as err:  # reported, not raised: the test names what the worker said
            error = str(err)
        handlers = logging.getLogger().handlers
        return {
            "pid": os.getpid(),
            "max_image_pixels": Image.MAX_IMAGE_PIXELS,
            "decode_error": error,
            "torch_threads": torch.get_num_threads(),
            "sigterm_ignored": signal.getsignal(signal.SIGTERM) is signal.SIG_IGN,
            "sigint_ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
            "log_format": handlers[0].formatter._fmt if handlers and handlers[0].formatter else "",  # type: ignore[union-attr]
            "lightning": sorted(name for name in ("lightning_fabric", "pytorch_lightning") if name in sys.modules),
            "main": getattr(sys.modules["__main__"], "__file__", None),  # the parent's script, where multiprocessing ran it
        }


def first_item(items: list[dict]) -> dict:
    return items[0]
