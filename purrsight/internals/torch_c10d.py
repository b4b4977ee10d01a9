"""PyTorch's flight recorder dump, which torch offers only privately (written against torch 2.13).

``torch._C._distributed_c10d._dump_fr_trace`` returns the pickled ring of this process's recent
collectives. Guarded: a build without it (or without a process group) dumps nothing and the
watchdog still names its culprit.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def flight_recorder_trace() -> bytes | None:
    """This process's flight recorder, pickled as PyTorch's analyser reads it; None where there is none."""
    try:
        import torch._C._distributed_c10d as c10d

        return bytes(c10d._dump_fr_trace())  # type: ignore[attr-defined]  # private: torch ships no stub for it
    except Exception as error:  # no recorder in this build, or no process group
        log.warning("flight recorder: nothing dumped (%s)", error)
        return None
