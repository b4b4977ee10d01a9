"""The measured side of ``train_phase2.py estimate``'s check: one short real training run on the CPU
(training/run.py's ``train``, Lightning and all) and the peak of the host memory its steps hold.

What is measured: glibc's bytes in use (``mallinfo2``: arena chunks in use plus mmapped blocks),
read after every aten op of the training batches (a dispatch mode entered at each batch's start
and left at its end: forward, backward and the optimizer step), minus the same figure just before
the run starts (after the imports). PyTorch's CPU allocator takes every tensor from malloc, so
this is the tensors' bytes plus whatever else the run keeps in malloc (Lightning's and the loader's
Python objects larger than 512 B, the tokenizer): it reads a little high, never low. Not RSS:
freed arena memory stays resident and imports page in code, which would measure glibc, not the
step. The estimate's figure is per-GPU bytes for ddp at 32-true (CPU training's precision).

    .venv/bin/python -m bench.model.train_peak --config config/train_config.yaml trainer.max_steps=2 ...

Prints ``PEAK {"baseline": B, "peak": P, "held": P - B}``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def malloc_in_use() -> int:
    info = _libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class _EveryOp(TorchDispatchMode):  # type: ignore[misc]  # torch ships the base untyped
    def __init__(self) -> None:
        super().__init__()
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, malloc_in_use())
        return out


class PeakOfSteps(pl.Callback):
    def __init__(self) -> None:
        self.mode = _EveryOp()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.mode.__enter__()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.mode.__exit__(None, None, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from purrsight.cli import setup_logging
    from purrsight.config import load_config
    from purrsight.training.run import train

    setup_logging()
    config = load_config(args.config, args.overrides)
    torch.set_num_threads(torch.get_num_threads())  # the thread pool exists before the baseline
    callback = PeakOfSteps()
    baseline = malloc_in_use()
    train(config, None, callbacks=[callback])
    print(
        "PEAK " + json.dumps({"baseline": baseline, "peak": callback.mode.peak, "held": callback.mode.peak - baseline}), flush=True
    )


if __name__ == "__main__":
    main()
