"""This process's cgroup limits, v1 and v2: the CPU quota and the memory limit a job's step sees.

A scheduler fences a job with cgroups (SLURM's task/cgroup, PBS's cgroup hook, a container),
on cgroup v1 (one hierarchy per controller, still what many sites run) or v2 (one hierarchy).
Where the hierarchy is mounted and which folder is ours come from /proc/self/mountinfo and
/proc/self/cgroup, never from a fixed path: a container sees its own cgroup as "/" under a
mount whose root is deeper. A limit set on a parent (SLURM's job folder above the step's)
binds the child too, so each reader takes the least along the path up to the mount's root.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC_SELF = Path("/proc/self")


@dataclass(frozen=True)
class Hierarchy:
    version: int  # 1 or 2
    folder: Path  # this process's cgroup folder in it
    top: Path  # the mount point: limits above it are not ours to see


def _mounts(proc: Path) -> list[tuple[str, Path, str, set[str]]]:
    """(root, mount point, fstype, super options) of every cgroup mount."""
    found = []
    for line in (proc / "mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            found.append((fields[3], Path(fields[4]), tail[0], set(tail[2].split(","))))
    return found


def hierarchy(controller: str, proc: Path = PROC_SELF) -> Hierarchy | None:
    """This process's folder in the hierarchy that holds ``controller`` (cpu, memory): v1 first, as the kernel does."""
    try:
        lines = (proc / "cgroup").read_text().splitlines()
        mounts = _mounts(proc)
    except OSError:
        return None
    unified = None
    for line in lines:
        number, controllers, path = line.split(":", 2)
        if number == "0" and not controllers:
            unified = path
        elif controller in controllers.split(","):
            for root, point, fstype, options in mounts:
                if fstype == "cgroup" and controller in options:
                    return Hierarchy(1, _inside(point, root, path), point)
    if unified is not None:
        for root, point, fstype, _ in mounts:
            if fstype == "cgroup2":
                available = point / "cgroup.controllers"
                if available.exists() and controller in available.read_text().split():
                    return Hierarchy(2, _inside(point, root, unified), point)
    return None


def _inside(point: Path, root: str, path: str) -> Path:
    # A cgroup namespace (containers) shows the path relative to the mount's root already.
    relative = path[len(root) :] if root != "/" and path.startswith(root) else path
    return point / relative.lstrip("/")


def _up_to_top(where: Hierarchy) -> list[Path]:
    folders, folder = [], where.folder
    while True:
        folders.append(folder)
        if folder == where.top or where.top not in folder.parents:
            return folders
        folder = folder.parent


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cpu_quota(proc: Path = PROC_SELF) -> float | None:
    """CPUs' worth of time the cgroup allows per period (cpu.max, cpu.cfs_quota_us); None when unlimited."""
    where = hierarchy("cpu", proc)
    if where is None:
        return None
    quotas = []
    for folder in _up_to_top(where):
        if where.version == 2:
            quota, _, period = (_read(folder / "cpu.max") or "max").partition(" ")
        else:
            quota, period = _read(folder / "cpu.cfs_quota_us") or "-1", _read(folder / "cpu.cfs_period_us") or "100000"
        if quota.lstrip("-").isdigit() and int(quota) > 0 and period.isdigit() and int(period) > 0:
            quotas.append(int(quota) / int(period))
    return min(quotas) if quotas else None


def memory_limit(proc: Path = PROC_SELF) -> int | None:
    """Bytes the cgroup allows (memory.max, memory.limit_in_bytes); None when unlimited."""
    where = hierarchy("memory", proc)
    if where is None:
        return None
    name = "memory.max" if where.version == 2 else "memory.limit_in_bytes"
    limits = [int(value) for folder in _up_to_top(where) if (value := _read(folder / name) or "").isdigit()]
    # v1 writes "no limit" as the largest page-aligned number (9223372036854771712): larger than any machine.
    limits = [limit for limit in limits if limit < 2**62]
    return min(limits) if limits else None
