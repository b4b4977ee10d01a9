"""Faults on demand for the reliability tests (docs/RELIABILITY.md); inert unless PURRSIGHT_FAULT is set."""

from __future__ import annotations

import os
import signal
from typing import Any

FAULT_ENV = "PURRSIGHT_FAULT"  # fault injection for the reliability tests (docs/RELIABILITY.md)


def inject_fault_during_write(stream: Any) -> None:
    """PURRSIGHT_FAULT=kill_during_checkpoint_write:N: SIGKILL this process during the N-th write.

    The temp file is half written and flushed when the kill lands, as when a node dies or
    the OOM killer strikes mid-save. Off unless the variable is set.
    """
    spec = os.environ.get(FAULT_ENV, "")
    first_generation = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")
    if not spec.startswith("kill_during_checkpoint_write:") or not first_generation:
        return  # restarted workers must be able to finish, or the fault would repeat forever
    global _writes_seen
    _writes_seen += 1
    if _writes_seen == int(spec.split(":", 1)[1]):
        stream.flush()
        os.kill(os.getpid(), signal.SIGKILL)


_writes_seen = 0
