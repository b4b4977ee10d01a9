"""The CPUs this job may use on this node: one rule for the launcher and for a batch job's Ray node.

The affinity mask (taskset, a scheduler's binding: SLURM's task/affinity or task/cgroup,
PBS's cpuset), not os.cpu_count(): on a shared 128-core node a job given 32 cores that sizes
its threads (or Ray its worker slots) by 128 oversubscribes its cores 4x. The cgroup's CPU
quota caps it (a container limited to 4 CPUs of a 64-core host), and SLURM_CPUS_PER_TASK
where SLURM counts CPUs without binding them (task/none): the launcher and a Ray node are
one task per node, so a task's CPUs are the node's share of the job.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from purrsight.launcher import cgroups


def usable_cpus(environ: Mapping[str, str], affinity: set[int] | None = None, proc: Path = cgroups.PROC_SELF) -> tuple[int, str]:
    """(CPUs this job may use on this node, where that number comes from): the least of the three."""
    if affinity is None and not hasattr(os, "sched_getaffinity"):  # macOS: no affinity masks
        cpus, source = os.cpu_count() or 1, "cores"
    else:
        cpus, source = len(affinity if affinity is not None else os.sched_getaffinity(0)), "affinity mask"
    quota = cgroups.cpu_quota(proc)
    if quota is not None and int(quota) < cpus:
        cpus, source = int(quota), "cgroup CPU quota"
    slurm = environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and 0 < int(slurm) < cpus:
        cpus, source = int(slurm), "SLURM_CPUS_PER_TASK"
    return max(1, cpus), source
