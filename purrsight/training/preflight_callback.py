"""Runs the preflight all-reduce once the process group exists, before the first step."""

from __future__ import annotations

import logging

import pytorch_lightning as pl

from purrsight.cluster.preflight import PreflightError, Report, run_preflight
from purrsight.config import PreflightConfig

log = logging.getLogger("purrsight.preflight")


class Preflight(pl.Callback):
    def __init__(self, config: PreflightConfig) -> None:
        self.config = config
        self.report: Report | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.config.mode == "off" or trainer.world_size == 1:
            return  # one process: no fabric to check
        report = run_preflight(self.config.mode, trainer.strategy.root_device, self.config.straggler_factor)
        self.report = report
        if trainer.is_global_zero:
            log.info("preflight all-reduce over %d ranks (sum check: exact on every size)\n%s", trainer.world_size, report.table())
            for straggler in report.stragglers:
                log.warning("preflight: straggler %s", straggler)
        floor = self.config.min_busbw_gbps
        largest = report.rows[-1]
        if floor is not None and largest.busbw_gbps < floor:
            raise PreflightError(
                f"preflight: bus bandwidth {largest.busbw_gbps:.3f} GB/s at the largest size is below "
                f"preflight.min_busbw_gbps={floor:g}; check the interconnect (NCCL_* settings, IB ports) or lower the floor"
            )
