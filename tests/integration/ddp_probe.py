"""Run by torchrun in test_train_ddp.py: train, recording each rank's sample ids and final weights."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from purrsight.cli import setup_logging
from purrsight.config import load_config
from purrsight.training.run import train


class Probe(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.seen: list[tuple[int, list[str]]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.seen.append((trainer.current_epoch, list(batch["ids"])))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        weights = {n: p.detach().cpu().clone() for n, p in pl_module.named_parameters() if p.requires_grad}
        torch.save({"seen": self.seen, "weights": weights}, self.out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    out, config_path, *overrides = sys.argv[1:]
    setup_logging()  # as train_phase2.py does: our format, Lightning's known noise silenced
    train(load_config(config_path, overrides), callbacks=[Probe(Path(out))])
