"""What one node's Ray may use in a batch job: CPUs, memory and the object store, from the allocation.

Read from the job's own limits (the affinity mask, the cgroup, v1 or v2, SLURM's memory
request in any of its three forms) rather than the machine's, which Ray would count: a job on
a shared node owns part of it. The CPUs follow the launcher's rule (purrsight.launcher.cpus),
so a Ray node and a torchrun node in the same allocation count the same CPUs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from purrsight.launcher import cgroups

OBJECT_STORE_SHARE = 0.3  # Ray's own default share of memory
MIN_OBJECT_STORE = 100 * 2**20  # Ray refuses less than 75 MiB
MIB = 2**20


def _number(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def slurm_memory(environ: Mapping[str, str], cpus: int, gpus: int) -> tuple[int, str] | None:
    """The job's memory on this node as SLURM granted it: --mem, --mem-per-cpu or --mem-per-gpu (MiB)."""
    per_node = _number(environ, "SLURM_MEM_PER_NODE")
    if per_node:
        return per_node * MIB, "SLURM_MEM_PER_NODE"
    per_cpu = _number(environ, "SLURM_MEM_PER_CPU")
    if per_cpu:
        # The job's CPUs on this node; the step's own when SLURM does not say (a step of this job may hold fewer).
        node_cpus = _number(environ, "SLURM_CPUS_ON_NODE") or cpus
        return per_cpu * node_cpus * MIB, f"SLURM_MEM_PER_CPU x {node_cpus} CPUs"
    per_gpu = _number(environ, "SLURM_MEM_PER_GPU")
    if per_gpu and gpus > 0:
        return per_gpu * gpus * MIB, f"SLURM_MEM_PER_GPU x {gpus} GPUs"
    return None


def memory_limit(
    environ: Mapping[str, str] | None = None, cpus: int = 1, gpus: int = 0, proc: Path = cgroups.PROC_SELF
) -> tuple[int, str]:
    """Bytes this job may hold on the node: the least of the cgroup's limit, SLURM's grant and the machine's memory."""
    environ = os.environ if environ is None else environ
    limits = [(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the machine's memory")]
    cgroup = cgroups.memory_limit(proc)
    if cgroup is not None:
        limits.append((cgroup, "the cgroup's memory limit"))
    granted = slurm_memory(environ, cpus, gpus)
    if granted is not None:
        limits.append(granted)
    return min(limits)


def object_store_bytes(memory: int, shm_free: int) -> int:
    """Ray's default share of the job's memory, held to what /dev/shm has free (beyond that
    Ray falls back to a slow disk-backed store, or fails to start)."""
    return max(MIN_OBJECT_STORE, min(int(memory * OBJECT_STORE_SHARE), int(shm_free * 0.9)))


def gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"
