"""CPU seconds of every process a benchmark starts, summed by the part of the stack it is.

A sampler thread walks the process trees under the given root pids every ``interval`` s
and keeps each process's latest user + system time. A process that exits between two
samples loses at most one interval of its time; the long-lived ones (workers, torchrun's
agent, the log writer) are sampled until their last interval. The part a process plays is
read from its command line (``role_of``).
"""

from __future__ import annotations

import threading
from collections import defaultdict

import psutil

ROLES = ("worker", "torchrun agent", "log writer", "prepare", "launcher other")


def role_of(cmdline: list[str]) -> str:
    command = " ".join(cmdline)
    if "purrsight.launcher.torchrun" in command or "torch.distributed.run" in command:
        return "torchrun agent"  # its command line names the training script too
    if "train_phase2.py" in command or "bench.plain_ddp" in command:
        return "worker"
    if "purrsight.launcher.logwriter" in command:
        return "log writer"
    if "purrsight.launcher.node_plan" in command:
        return "prepare"  # probe, config check, placement, run folder, environment, health checks
    return "launcher other"  # bash and its tools


class ProcessTreeCPU:
    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.roots: list[int] = []
        self.seen: dict[tuple[int, float], tuple[str, float]] = {}  # (pid, create time) -> (role, cpu s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ProcessTreeCPU:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def watch(self, pid: int) -> None:
        self.roots.append(pid)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        for root in list(self.roots):
            try:
                tree = [psutil.Process(root)]
                tree += tree[0].children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for process in tree:
                try:
                    with process.oneshot():
                        key = (process.pid, process.create_time())
                        times = process.cpu_times()
                        role = self.seen[key][0] if key in self.seen else role_of(process.cmdline())
                except psutil.NoSuchProcess:
                    continue
                self.seen[key] = (role, times.user + times.system)

    def by_role(self) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for role, seconds in self.seen.values():
            totals[role] += seconds
        return {role: totals.get(role, 0.0) for role in ROLES}
