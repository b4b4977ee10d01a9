"""What one node's Ray may use in a batch job: CPUs, memory and the object store, from the allocation.

Read from the process's own limits (affinity mask, cgroup v2, SLURM's --mem) rather than the
machine's, which Ray would count: a job on a shared node owns part of it.
"""

from __future__ import annotations

import os
from pathlib import Path

OBJECT_STORE_SHARE = 0.3  # Ray's own default share of memory
MIN_OBJECT_STORE = 100 * 2**20  # Ray refuses less than 75 MiB


def cgroup_file(name: str) -> Path | None:
    """``name`` in this process's cgroup v2 folder (SLURM's job/step cgroup, a container's)."""
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    path = Path("/sys/fs/cgroup") / line.split("::", 1)[-1].lstrip("/") / name
    return path if line.startswith("0::") and path.exists() else None


def cpu_count() -> tuple[int, str]:
    """CPUs this node's Ray may use: the affinity mask, capped by the cgroup's CPU quota."""
    cpus, source = len(os.sched_getaffinity(0)), "affinity mask"
    quota_file = cgroup_file("cpu.max")
    if quota_file is not None:
        quota, _, period = quota_file.read_text().partition(" ")
        if quota != "max" and int(period or 100000) > 0:
            capped = max(1, int(int(quota) / int(period)))
            if capped < cpus:
                cpus, source = capped, "cgroup cpu.max"
    return cpus, source


def memory_limit() -> tuple[int, str]:
    """Bytes this job may hold on the node: the least of the cgroup's limit, SLURM's and the machine's."""
    limits = [(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the machine's memory")]
    limit_file = cgroup_file("memory.max")
    if limit_file is not None and limit_file.read_text().strip().isdigit():
        limits.append((int(limit_file.read_text()), "cgroup memory.max"))
    if os.environ.get("SLURM_MEM_PER_NODE", "").isdigit():
        limits.append((int(os.environ["SLURM_MEM_PER_NODE"]) * 2**20, "SLURM_MEM_PER_NODE"))
    return min(limits)


def object_store_bytes(memory: int, shm_free: int) -> int:
    """Ray's default share of the job's memory, held to what /dev/shm has free (beyond that
    Ray falls back to a slow disk-backed store, or fails to start)."""
    return max(MIN_OBJECT_STORE, min(int(memory * OBJECT_STORE_SHARE), int(shm_free * 0.9)))


def gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"
