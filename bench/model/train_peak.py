"""The measured side of ``train_phase2.py estimate``'s check: one short real training run on the CPU
(training/run.py's ``train``, Lightning and all) and the peak of the tensor bytes its steps hold.

What is measured: the bytes of every tensor storage alive, read after every aten op of the training
batches (a dispatch mode entered at each batch's start and left at its end: forward, backward and
the optimizer step). The storages alive when the steps start (the model's parameters and buffers,
the optimizer's state, the batch) are registered then; every storage an op makes is registered as
it appears, and each leaves the count when it is freed (a weak reference to the storage). This is
what the estimate counts: parameters, gradients, optimizer state, activations, logits.

Not malloc's bytes in use (what this script read until 2026-11-27): a CPU's BLAS and oneDNN keep
buffers of their own from a shape's first call (4 MiB per matmul shape of the tiny default on
one machine, 18 MiB in the first forward), their size depends on the CPU's instruction set, and
they are no tensor: the same run measured 9 MiB more than its tensors on one machine and 26 MiB
on another. Not RSS either: freed arena memory stays resident and imports page in code.
The estimate's figure is per-GPU bytes for ddp at 32-true (CPU training's precision).

    .venv/bin/python -m bench.model.train_peak --config config/train_config.yaml trainer.max_steps=2 ...

Prints ``PEAK {"peak": P, "held": P}`` (held: the peak tensor bytes of the steps).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveStorages:
    """The bytes of the tensor storages registered and not yet freed."""

    def __init__(self) -> None:
        self.handles: dict[int, tuple[int, int]] = {}  # data pointer -> (weak reference handle, bytes)
        self.bytes = 0

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer == 0 or pointer in self.handles:
            return  # empty, or a view of a storage counted already
        handle: int = storage._weak_ref()  # type: ignore[assignment]  # an int handle at runtime; torch's stub says a storage
        self.handles[pointer] = (handle, storage.nbytes())
        self.bytes += storage.nbytes()

    def drop_freed(self) -> None:
        for pointer, (handle, size) in list(self.handles.items()):
            if torch.UntypedStorage._expired(handle):
                torch.UntypedStorage._free_weak_ref(handle)
                del self.handles[pointer]
                self.bytes -= size


class _EveryOp(TorchDispatchMode):  # type: ignore[misc]  # torch ships the base untyped
    def __init__(self, live: LiveStorages) -> None:
        super().__init__()
        self.live = live
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.live.drop_freed()  # an op's inputs may be gone before its outputs count
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu" and not leaf.is_meta:
                self.live.add(leaf)
        self.peak = max(self.peak, self.live.bytes)
        return out


class PeakOfSteps(pl.Callback):
    def __init__(self) -> None:
        self.live = LiveStorages()
        self.mode = _EveryOp(self.live)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        state = [value for optimizer in trainer.optimizers for slots in optimizer.state.values() for value in slots.values()]
        for leaf in [*pl_module.parameters(), *pl_module.buffers(), *state, *tree_leaves(batch)]:
            if isinstance(leaf, torch.Tensor):
                self.live.add(leaf)
                if leaf.grad is not None:
                    self.live.add(leaf.grad)
        self.live.drop_freed()
        self.mode.peak = max(self.mode.peak, self.live.bytes)
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
    callback = PeakOfSteps()
    train(config, None, callbacks=[callback])
    print("PEAK " + json.dumps({"peak": callback.mode.peak, "held": callback.mode.peak}), flush=True)


if __name__ == "__main__":
    main()
