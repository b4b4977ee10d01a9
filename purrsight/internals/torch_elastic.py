"""torchelastic's internals the launcher's torchrun wrapper relies on (written against torch 2.13).

- ``_terminate_process_handler``: the module-level name ``PContext.start()`` looks up when it
  installs each agent's SIGTERM/SIGINT handler. Replacing it is the one way to make the agent
  stop once per job (purrsight/launcher/torchrun.py says why). Where it has moved,
  ``install_terminate_handler`` says so in one line and torchrun keeps its own handler: the job
  still stops, a second signal may cut the workers' close short.
- ``RENDEZVOUS_METRIC``: the name torchelastic's ``@prof`` gives the timing of
  ``SimpleElasticAgent._rendezvous``. Where it has changed, the rendezvous lines are simply absent.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType

RENDEZVOUS_METRIC = "._rendezvous.duration.ms"
HANDLER_NAME = "_terminate_process_handler"

Handler = Callable[[int, FrameType | None], None]


def install_terminate_handler(handler: Handler) -> bool:
    """Make ``handler`` the one torchelastic installs in its agent; False (and one line) where it cannot."""
    from torch.distributed.elastic.multiprocessing import api

    if not callable(getattr(api, HANDLER_NAME, None)):
        print(
            f"torchrun: torch.distributed.elastic.multiprocessing.api has no {HANDLER_NAME} in this torch; "
            "a second stop signal may cut the workers' close short",
            file=sys.stderr,
            flush=True,
        )
        return False
    setattr(api, HANDLER_NAME, handler)
    return True
