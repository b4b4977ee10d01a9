"""Counting, on a CPU, the calls that would make the host wait for a GPU.

On CUDA the host queues kernels and runs ahead; it stops to wait for every queued kernel when
it reads a device value (``.item()``, ``.tolist()``, ``bool()``, ``int()``, ``float()``),
copies a tensor to the host (``.cpu()``, ``.numpy()``), or runs an op whose output size
depends on the data (``nonzero``, indexing with a boolean mask). On a CPU none of these cost
anything, so a CPU run cannot show them in a profile; counting the calls can. A
``TorchFunctionMode`` sees every tensor method call and torch function in this thread.

Each counted call is attributed to the code that made it: the innermost frame outside torch's
tensor plumbing (ours, Lightning's, transformers'), and for torch's own code (the optimizer)
also the first frame outside torch.
"""

from __future__ import annotations

import os
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pytorch_lightning as pl
import torch
from torch.overrides import TorchFunctionMode

from purrsight.config import load_config
from purrsight.data.synthetic import generate
from purrsight.training.run import train
from tests.format_sets import items_of, write_llava

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "config" / "train_config.yaml"
# On a CPU the optimizer keeps each parameter's step counter in a host tensor and reads it
# every step; on CUDA build_optimizer takes the fused kernel, whose counters stay on the GPU.
OPTIMIZER = "torch/optim/"

SYNCING = frozenset(
    {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere", "masked_select"}
)
INDEXING = frozenset({"__getitem__", "__setitem__", "index_put_", "index_put"})
TORCH = "/site-packages/torch/"
PLUMBING = ("torch/_tensor.py", "torch/overrides.py", "torch/utils/_contextlib.py", "tests/host_syncs.py")


def _has_mask(index: Any) -> bool:
    """True for an index that holds a boolean tensor: its result's size depends on the data."""
    if isinstance(index, tuple | list):
        return any(_has_mask(part) for part in index)
    return isinstance(index, torch.Tensor) and index.dtype == torch.bool


def _short(frame: traceback.FrameSummary) -> str:
    path = frame.filename.split("/site-packages/")[-1].removeprefix(f"{REPO}/")
    return f"{path}:{frame.lineno} ({frame.name})"


def _caller() -> str:
    """Who made the call: the innermost frame outside torch's tensor plumbing, and when that is
    torch's own code (the optimizer), the first frame outside torch too."""
    frames = [f for f in traceback.extract_stack()[:-2] if not f.filename.endswith(PLUMBING)]
    innermost = frames[-1]
    if TORCH not in innermost.filename:
        return _short(innermost)
    outside = next((f for f in reversed(frames) if TORCH not in f.filename), innermost)
    return f"{_short(innermost)} <- {_short(outside)}"


class HostSyncCounter(TorchFunctionMode):
    """Counts syncing calls while ``active``: ``calls[(name, caller)]``."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.calls: Counter[tuple[str, str]] = Counter()
        self.batch_keys: set[str] = set()  # the counted step's batch: what the step was given

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if self.active:
            name = getattr(func, "__name__", "")
            if name in SYNCING or (name in INDEXING and len(args) > 1 and _has_mask(args[1])):
                self.calls[(name, _caller())] += 1
        return func(*args, **(kwargs or {}))

    def total(self) -> int:
        return sum(self.calls.values())

    def device_reads(self) -> Counter[tuple[str, str]]:
        """The calls but the optimizer's reads of its host-side step counters."""
        return Counter({key: n for key, n in self.calls.items() if not key[1].startswith(OPTIMIZER)})

    def report(self) -> str:
        return "\n".join(
            f"{n:3d}  {name:<14} {caller}" for (name, caller), n in sorted(self.calls.items(), key=lambda kv: kv[0][1])
        )


class CountStep(pl.Callback):
    """Counts from the start of batch ``batch_idx`` to the start of the next: the forward,
    backward, optimizer step and every per-step hook (the module's and each callback's),
    whatever their order in the callbacks list."""

    def __init__(self, counter: HostSyncCounter, batch_idx: int) -> None:
        self.counter = counter
        self.batch_idx = batch_idx

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.counter.active = batch_idx == self.batch_idx
        if self.counter.active:
            self.counter.batch_keys = set(batch)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.counter.active = False


class CudaSyncsFail(pl.Callback):
    """On a GPU, the real thing: CUDA's sync debug mode raises on any synchronising call made
    from the start of batch ``batch_idx`` to the start of the next."""

    def __init__(self, batch_idx: int) -> None:
        self.batch_idx = batch_idx

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        torch.cuda.set_sync_debug_mode("error" if batch_idx == self.batch_idx else "default")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.cuda.set_sync_debug_mode("default")


@contextmanager
def counting() -> Iterator[HostSyncCounter]:
    counter = HostSyncCounter()
    with counter:
        yield counter


def count_step(
    work: Path, steps: int, step: int, overrides: list[str], callbacks: list[pl.Callback] | None = None
) -> HostSyncCounter:
    """Train the tiny default config for ``steps`` steps in this process and count step ``step``
    (1-based), inside a one-rank gloo process group so the collectives of a multi-rank run (the
    stop vote) run too. ``step`` should be no logging, telemetry, checkpoint or validation step.

    The training set is the generated one as a LLaVA file with its placeholders in front of, inside
    and after the prompts, in length-grouped batches: the step places the media in the text
    (PurrSightModel.build_inputs' widest path)."""
    data = generate(work / "data", 64, 8, 0)
    train_index = write_llava(work / "data", items_of(data), where="varied")
    config = load_config(
        DEFAULT_CONFIG,
        [
            f"run.output_dir={work / 'runs'}",
            f"data.synthetic_dir={data}",
            f"data.train_index={train_index}",
            "data.group_by_length=true",
            f"data.val_index={data / 'val.jsonl'}",
            "data.batch_size=4",
            "data.num_workers=1",  # the collator runs in a loader worker, outside the counted thread
            f"trainer.max_steps={steps}",
            "logging.progress=lines",
            *overrides,
        ],
    )
    one_rank = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "RANK": "0", "WORLD_SIZE": "1"}
    with mock.patch.dict(os.environ, one_rank):
        store = torch.distributed.FileStore(str(work / "store"), 1)
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
        try:
            with counting() as counter:
                train(config, callbacks=[CountStep(counter, step - 1), *(callbacks or [])])  # batch_idx counts from 0
        finally:
            torch.distributed.destroy_process_group()
    return counter
