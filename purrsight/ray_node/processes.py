"""This node's Ray as a process tree: kept whole while it runs, taken down whole at the end.

Ray renames its processes (setproctitle: a worker shows as ``ray::RayTrainWorker.train``, its
data loaders the same), so no command line tells which are this job's. The tree does: the
node process makes itself a child subreaper (prctl PR_SET_CHILD_SUBREAPER), so a process
whose parent dies (a worker's orphaned loader, a daemon Ray double-forks) is handed to it
instead of to init, and every process Ray started stays below it until the teardown. That
works the same under any scheduler (SLURM's cgroup or process tracking, PBS's, ssh's none),
and never touches another job's or user's Ray on the node.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>


def become_subreaper() -> bool:
    """Orphans of our descendants come to us, not to init; False where the kernel has no such call."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _stat(pid: str) -> tuple[int, str] | None:
    """(parent pid, state) of ``pid``; None once it is gone."""
    try:
        after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(after_name[1]), after_name[0]


def descendants(root: int) -> dict[int, str]:
    """Every process below ``root`` (pid -> state, "Z" for a zombie), read from /proc in one pass."""
    parents: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (found := _stat(entry)) is not None:
            parents.setdefault(found[0], []).append((int(entry), found[1]))
    below: dict[int, str] = {}
    todo = [root]
    while todo:
        for pid, state in parents.get(todo.pop(), []):
            if pid not in below:
                below[pid] = state
                todo.append(pid)
    return below


def reap_adopted(root: int, keep: set[int]) -> None:
    """Collect our zombie children (orphans handed to us as subreaper, once they end), except ``keep``."""
    for pid, state in descendants(root).items():
        if state == "Z" and pid not in keep:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)


def kill_tree(root: int, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every process below ``root`` until none is left (a killed parent's children come up to
    us and are killed in the next pass); the pids still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid, state in descendants(root).items() if state != "Z"]
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        reap_adopted(root, keep=set())
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)
