"""Run by torchrun in test_fsdp.py (and tests/gpu): ddp_probe.py's record under distributed.strategy=fsdp.

Besides the samples, the micro-batches of each optimizer step and the final trainable weights
(gathered whole), each rank records the reduce-scatters FSDP issued in each optimizer step, the
units holding trainable parameters, its gathered peak during forwards and the bound one unit at a
time allows (tests/fsdp_watch.py), and the dtype a LoRA weight has while gathered."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

import pytorch_lightning as pl
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from purrsight.cli import setup_logging
from purrsight.config import load_config
from purrsight.training.run import train
from tests.fsdp_watch import GatheredPeak, counting_reduce_scatters, one_unit_bound, units_with_gradients
from tests.integration.ddp_probe import Probe


class FsdpProbe(Probe):
    def __init__(self, out: Path, reduce_scatters: list[int]) -> None:
        super().__init__(out)
        self.reduce_scatters = reduce_scatters  # the running count, kept by counting_reduce_scatters
        self.per_step: list[int] = []
        self._at_step_start = 0
        self.units = 0
        self.peak: GatheredPeak | None = None
        self.lora_gathered = ""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)  # the broadcasts counted, as under DDP
        model: Any = pl_module.model
        assert model is not None
        self.units = units_with_gradients(model)
        self.peak = GatheredPeak(model)
        lora = next(m for n, m in model.named_modules() if n.endswith("lora_A.default"))

        def dtype_seen(module: torch.nn.Module, args: Any) -> None:
            self.lora_gathered = self.lora_gathered or str(module.weight.dtype)

        lora.register_forward_pre_hook(dtype_seen)
        self._at_step_start = self.reduce_scatters[0]

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        self.per_step.append(self.reduce_scatters[0] - self._at_step_start)  # the window's backwards are done
        self._at_step_start = self.reduce_scatters[0]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.peak is not None and pl_module.model is not None
        broadcasts = self.stop_counting_broadcasts()
        weights = {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for n, p in pl_module.named_parameters()
            if p.requires_grad
        }  # every rank joins each gather
        probe: dict[str, Any] = {"seen": self.seen, "weights": weights, "micro_batches": self.micro_batches}
        probe["broadcasts"] = broadcasts
        probe |= {"reduce_scatters": self.per_step, "units_with_gradients": self.units, "lora_gathered": self.lora_gathered}
        probe |= {"gathered_peak": self.peak.peak, "one_unit_bound": one_unit_bound(cast(nn.Module, pl_module.model))}
        if torch.cuda.is_available():
            probe["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        torch.save(probe, self.out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    out, config_path, *overrides = sys.argv[1:]
    setup_logging()  # as train_phase2.py does: our format, Lightning's known noise silenced
    with counting_reduce_scatters() as count:
        train(load_config(config_path, overrides), callbacks=[FsdpProbe(Path(out), count)])
