"""Runs the preflight all-reduce once the process group exists, before the first step."""

from __future__ import annotations

import logging

import pytorch_lightning as pl

from purrsight.bad_nodes import name_bad_node
from purrsight.config import PreflightConfig
from purrsight.distributed.preflight import PreflightError, Report, run_preflight, straggler_ranks

log = logging.getLogger("purrsight.preflight")


def gather_node_names(world_size: int) -> dict[int, str]:
    """{rank: the scheduler's name for its node} (SLURMD_NODENAME, else the host name)."""
    import os
    import socket

    import torch.distributed as dist

    gathered: list[object] = [None] * world_size
    dist.all_gather_object(gathered, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
    return {rank: str(name) for rank, name in enumerate(gathered)}


class Preflight(pl.Callback):
    def __init__(self, config: PreflightConfig) -> None:
        self.config = config
        self.report: Report | None = None
        self.node_names: dict[int, str] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.config.mode == "off" or trainer.world_size == 1:
            return  # one process: no fabric to check
        report = run_preflight(self.config.mode, trainer.strategy.root_device, self.config.straggler_factor)
        self.report = report
        if self.config.min_busbw_gbps is not None:  # every rank, floor or not: a collective
            self.node_names = gather_node_names(trainer.world_size)
        if trainer.is_global_zero:
            log.info("preflight all-reduce over %d ranks (sum check: exact on every size)\n%s", trainer.world_size, report.table())
            for straggler in report.stragglers:
                log.warning("preflight: straggler %s", straggler)
        floor = self.config.min_busbw_gbps
        largest = report.rows[-1]
        if floor is not None and largest.busbw_gbps < floor:
            if trainer.is_global_zero:
                self._name_straggler_nodes(report)
            raise PreflightError(
                f"preflight: bus bandwidth {largest.busbw_gbps:.3f} GB/s at the largest size is below "
                f"preflight.min_busbw_gbps={floor:g}; check the interconnect (NCCL_* settings, IB ports) or lower the floor"
            )

    def _name_straggler_nodes(self, report: Report) -> None:
        """A floor missed with stragglers: their nodes go to the job's bad-node file (the scheduler excludes them).

        Without a straggler the whole fabric is slow: no node is to blame, none is named.
        """
        names = self.node_names
        for rank in straggler_ranks(report.local_seconds, self.config.straggler_factor):
            line = name_bad_node(["preflight"], node=names.get(rank))
            if line:
                log.error("preflight: node %s is named in the job's bad-node file", line.split("\t")[0])
