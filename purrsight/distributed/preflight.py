"""Preflight all-reduce: prove the fabric before the first training step.

Every rank all-reduces tensors of several sizes, checks each result is the exact expected
sum, and rank 0 prints a table with the nccl-tests definitions:

    algbw = bytes / time            busbw = algbw * 2 (n - 1) / n

Stragglers: a collective takes as long on every rank (the fast ones wait inside it), so
each iteration also times a fixed piece of local work before the collective; a rank whose
local time exceeds ``straggler_factor`` x the median is named with its node. With
``min_busbw_gbps`` set, a bus bandwidth below it at the largest size fails the job.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from purrsight.errors import ClusterError

SIZES = {  # bytes per all-reduce, by (mode, device type)
    ("quick", "cpu"): [2**10, 2**16, 2**20, 2**22],
    ("quick", "cuda"): [2**20, 2**24, 2**26],
    ("full", "cpu"): [2**10, 2**14, 2**18, 2**20, 2**22, 2**24],
    ("full", "cuda"): [2**20, 2**22, 2**24, 2**26, 2**28, 2**29],
}
ITERATIONS = {"quick": 3, "full": 10}


class PreflightError(ClusterError):
    """The fabric failed the preflight (wrong sums, or bandwidth below the floor)."""


@dataclass
class Row:
    size: int
    seconds: float
    algbw_gbps: float
    busbw_gbps: float


@dataclass
class Report:
    rows: list[Row]
    local_seconds: dict[int, tuple[int, float]]  # rank -> (node, median local-work time)
    stragglers: list[str]

    def table(self) -> str:
        lines = [f"{'size':>10} {'time ms':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}"]
        for row in self.rows:
            lines.append(f"{_human(row.size):>10} {row.seconds * 1e3:>10.3f} {row.algbw_gbps:>11.3f} {row.busbw_gbps:>11.3f}")
        nodes: dict[int, float] = {}
        for node, seconds in self.local_seconds.values():
            nodes[node] = max(nodes.get(node, 0.0), seconds)
        lines.append("local work per node (ms): " + ", ".join(f"node {n} {s * 1e3:.2f}" for n, s in sorted(nodes.items())))
        return "\n".join(lines)


def _human(size: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size // scale} {unit}"
    return f"{size} B"


def bus_bandwidth(algbw: float, world: int) -> float:
    return algbw * 2 * (world - 1) / world


def _local_work(device: torch.device) -> None:
    """A fixed matmul: the same work on every rank, so its time compares the nodes."""
    a = torch.ones(256, 256, device=device)
    (a @ a).sum().item()


def run_preflight(mode: str, device: torch.device, straggler_factor: float) -> Report:
    """Every rank calls this after the process group exists; returns the same report on all ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    node = int(os.environ.get("GROUP_RANK", "0"))
    expected = world * (world + 1) / 2  # ranks contribute 1, 2, ..., n: small integers sum exactly
    rows, local_times = [], []
    for size in SIZES[(mode, "cuda" if device.type == "cuda" else "cpu")]:
        tensor = torch.empty(size // 4, dtype=torch.float32, device=device)
        tensor.fill_(rank + 1)
        dist.all_reduce(tensor)  # warm-up: connections, buffers
        times = []
        for _ in range(ITERATIONS[mode]):
            tensor.fill_(rank + 1)
            dist.barrier()
            start = time.perf_counter()
            _local_work(device)
            local_times.append(time.perf_counter() - start)
            dist.barrier()  # a late rank delays this barrier, not the timed collective below
            begin = time.perf_counter()
            dist.all_reduce(tensor)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - begin)
            if not bool((tensor == expected).all()):
                bad = float(tensor[(tensor != expected).nonzero()[0]].item())
                raise PreflightError(
                    f"preflight: all-reduce of {_human(size)} returned {bad}, expected {expected:g} "
                    f"on rank {rank}: a corrupting link or device"
                )
        seconds = statistics.median(times)
        # the slowest rank's view is the collective's time
        slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds = float(slowest.item())
        algbw = size / seconds / 1e9
        rows.append(Row(size, seconds, algbw, bus_bandwidth(algbw, world)))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (rank, node, statistics.median(local_times)))
    local = {r: (n, s) for r, n, s in gathered}
    return Report(rows, local, find_stragglers(local, straggler_factor))


def straggler_ranks(local: dict[int, tuple[int, float]], factor: float) -> list[int]:
    """Ranks slower than ``factor`` x the median of the *other* ranks.

    Leave-one-out: with two ranks the plain median is their mean, which a single slow rank
    can never exceed twofold.
    """
    found = []
    for rank, (_node, seconds) in sorted(local.items()):
        others = [s for r, (_, s) in local.items() if r != rank]
        median = statistics.median(others) if others else seconds
        if seconds > factor * max(median, 1e-6):
            found.append(rank)
    return found


def find_stragglers(local: dict[int, tuple[int, float]], factor: float) -> list[str]:
    """One line per straggler rank (straggler_ranks): its node, its time and the others' median."""
    lines = []
    for rank in straggler_ranks(local, factor):
        node, seconds = local[rank]
        median = statistics.median(s for r, (_, s) in local.items() if r != rank) if len(local) > 1 else seconds
        lines.append(f"rank {rank} (node {node}): local work {seconds * 1e3:.1f} ms vs median {median * 1e3:.1f} ms")
    return lines
