"""The CPU time of a process and of everything it ever starts, orphans included: a cgroup of its own.

``os.times()`` counts only children a process waited for. A test's launcher does wait for its
torchrun agent, but the agent's fork server (the workers' parent) and every DataLoader fork server
are never waited for: they outlive their parent and are reaped by init, their CPU counted nowhere.
A cgroup counts them all: a process moved into it takes every later descendant with it.

Where a cgroup can be made (root, cgroup v1's ``cpuacct`` or cgroup v2), the process that runs the
tests moves itself into one of its own under its present one, so its CPU accounting is the
kernel's. Elsewhere (a user's laptop, not root, a container's read-only cgroupfs) the caller keeps
``os.times()``, and its report says so. Only accounting is changed: on v1 only a ``cpuacct``
mounted on its own is used (mounted with ``cpu``, as systemd does, the group would be a CPU weight
of its own), on v2 only under a group that gives its children no ``cpu`` controller; memory,
pids and the freezer (SLURM's proctrack) stay where they were, and a v2 group is a child of the
present one, under every limit of it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from collections.abc import Callable
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/cpuacct")
PREFIX = "purrsight-tests-"


def _own_path(hierarchy: str) -> str | None:
    """This process's cgroup in ``hierarchy`` (a v1 controller name, or "" for v2) from /proc/self/cgroup;
    None for a v1 cpuacct mounted with cpu (the usual systemd layout): a group there would also be a
    CFS weight of its own, every test process sharing one process's CPU share."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if not hierarchy and controllers == "":
            return path
        if hierarchy and hierarchy in controllers.split(","):
            return None if "cpu" in controllers.split(",") else path
    return None


def _v2_root() -> Path | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" - ", 1)
        if len(fields) == 2 and fields[1].startswith("cgroup2 "):
            return Path(fields[0].split()[4])
    return None


def _usage_reader(group: Path) -> Callable[[], float] | None:
    """Seconds of CPU the group has used, read from v1's cpuacct.usage (ns) or v2's cpu.stat (us)."""
    if (group / "cpuacct.usage").exists():
        return lambda: int((group / "cpuacct.usage").read_text()) / 1e9
    if (group / "cpu.stat").exists():

        def usage() -> float:
            stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
            return int(stat["usage_usec"]) / 1e6

        return usage
    return None


def _candidates() -> list[Path]:
    """Where this process's group would go: under its v1 cpuacct group, else under its v2 group."""
    found = []
    own = _own_path("cpuacct") if V1_ROOT.is_dir() else None
    if own is not None:
        found.append(V1_ROOT / own.lstrip("/"))
    root, own = _v2_root(), _own_path("")
    if root is not None and own is not None:
        parent = root / own.lstrip("/")
        subtree = parent / "cgroup.subtree_control"
        if not (subtree.exists() and "cpu" in subtree.read_text().split()):  # as v1's cpu: a weight of its own
            found.append(parent)
    return found


def _remove_stale(parent: Path) -> None:
    """Groups of processes that have ended (a group is named by its pid), with those made inside
    them (a test that ran pytest), deepest first; rmdir refuses a group that still holds a process."""
    for stale in parent.glob(f"{PREFIX}*"):
        if _alive(int(stale.name.removeprefix(PREFIX) or 0)):
            continue  # a sibling xdist worker's, or this run's serial pytest's
        for group in sorted((p for p in stale.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                group.rmdir()
        with contextlib.suppress(OSError):
            stale.rmdir()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


def move_into_own_cgroup() -> Callable[[], float] | None:
    """Move this process into a new cgroup; a reader of that group's CPU seconds, or None where it cannot."""
    for parent in _candidates():
        group = parent / f"{PREFIX}{os.getpid()}"
        try:
            _remove_stale(parent)
            group.mkdir(exist_ok=True)
            read = _usage_reader(group)
            if read is None:
                group.rmdir()
                continue
            (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
        except OSError:  # not root, a read-only cgroupfs, a v2 group with controllers that forbid it
            with contextlib.suppress(OSError):
                group.rmdir()
            continue
        atexit.register(_leave, parent, group)
        return read
    return None


def _leave(parent: Path, group: Path) -> None:
    """Back to the parent group; the group goes once its last orphan has ended (the next run's
    _remove_stale, if any is still running now)."""
    with contextlib.suppress(OSError):
        (parent / "cgroup.procs").write_text(f"{os.getpid()}\n")
        group.rmdir()
