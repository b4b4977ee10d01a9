"""Run by torchrun in test_train_ddp.py: train, recording each rank's sample ids, the micro-batches
each optimizer step took, final weights, how many gradient all-reduces DDP issued (a counting comm
hook around the default all-reduce), DDP's bucket size and the process group's timeout."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from purrsight.cli import setup_logging
from purrsight.config import load_config
from purrsight.training.run import train


class Probe(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.seen: list[tuple[int, list[str]]] = []
        self.micro_batches: list[int] = []  # per optimizer step
        self._since_step = 0
        self.allreduces = 0
        self.bucket_bytes = 0
        self.timeout_s = 0.0
        self.broadcasts = 0  # torch.distributed.broadcast calls while training (Lightning's SIGTERM flag was one a micro-batch)
        self._broadcast: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ddp = trainer.strategy.model
        if isinstance(ddp, DistributedDataParallel):
            self.bucket_bytes = ddp.bucket_bytes_cap
            # the process group's own timeout (no public getter: read from the gloo backend's options)
            backend = cast(dist.ProcessGroup, dist.group.WORLD)._get_backend(torch.device("cpu"))
            self.timeout_s = backend.options._timeout.total_seconds()

            # No annotations: DDP checks them against dist.GradBucket, and this module's are strings.
            def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]
                self.allreduces += 1
                return default_hooks.allreduce_hook(cast(dist.ProcessGroup, dist.group.WORLD), bucket)

            ddp.register_comm_hook(None, counting_allreduce)

        self._broadcast = dist.broadcast

        def counting_broadcast(*args: Any, **kwargs: Any) -> Any:
            self.broadcasts += 1
            return self._broadcast(*args, **kwargs)

        dist.broadcast = counting_broadcast  # type: ignore[assignment]  # callers look it up on the module at each call

    def stop_counting_broadcasts(self) -> int:
        """The real broadcast back (validation and export follow training); the count while training."""
        dist.broadcast = self._broadcast or dist.broadcast
        return self.broadcasts

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.seen.append((trainer.current_epoch, list(batch["ids"])))
        self._since_step += 1

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.micro_batches.append(self._since_step)
        self._since_step = 0

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        broadcasts = self.stop_counting_broadcasts()
        weights = {n: p.detach().cpu().clone() for n, p in pl_module.named_parameters() if p.requires_grad}
        probe = {"seen": self.seen, "weights": weights, "allreduces": self.allreduces, "bucket_bytes": self.bucket_bytes}
        probe["timeout_s"] = self.timeout_s
        probe["micro_batches"] = self.micro_batches
        probe["broadcasts"] = broadcasts
        torch.save(probe, self.out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    out, config_path, *overrides = sys.argv[1:]
    setup_logging()  # as train_phase2.py does: our format, Lightning's known noise silenced
    train(load_config(config_path, overrides), callbacks=[Probe(Path(out))])
