"""A process that dies with the one that started it (Linux's parent-death signal).

Used where a child must never outlive its starter, even when the starter is SIGKILLed and runs no
handler: a loader's fork server (its trainer gone, data/loader_fork_server.py) and a node's
``ray start`` (its node process gone, ray_node/node.py; Ray's own daemons share ``ray start``'s
fate in turn, and its workers end with their raylet). The signal fires when the starting thread
ends: call it in a child started from the main thread.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> None:
    """SIGKILL this process when the one that started it ends (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def process_ended(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or a zombie its parent has not reaped yet. One we may
    not signal is someone's, alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return True
