"""torchelastic's internals the launcher's torchrun wrapper relies on (written against torch 2.13).

- ``_terminate_process_handler``: the module-level name ``PContext.start()`` looks up when it
  installs each agent's SIGTERM/SIGINT handler. Replacing it is the one way to make the agent
  stop once per job (purrsight/launcher/torchrun.py says why). Where it has moved,
  ``install_terminate_handler`` says so in one line and torchrun keeps its own handler: the job
  still stops, a second signal may cut the workers' close short.
- ``RENDEZVOUS_METRIC``: the name torchelastic's ``@prof`` gives the timing of
  ``SimpleElasticAgent._rendezvous``. Where it has changed, the rendezvous lines are simply absent.
- ``run_script_path``: the function ``torch.distributed.run.config_from_args`` names as the
  workers' entry point under ``--run-path``, looked up in its module at each call. Replacing it
  runs each worker through ``purrsight.launcher.forked_workers.run_worker`` (its own session and
  signals). Where it has moved, ``install_worker_entry`` says so in one line and the workers are
  started as subprocesses, as without ``--run-path``: slower to start, nothing else differs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType, ModuleType

RENDEZVOUS_METRIC = "._rendezvous.duration.ms"
HANDLER_NAME = "_terminate_process_handler"
WORKER_ENTRY_NAME = "run_script_path"

Handler = Callable[[int, FrameType | None], None]


def install_terminate_handler(handler: Handler) -> bool:
    """Make ``handler`` the one torchelastic installs in its agent; False (and one line) where it cannot."""
    from torch.distributed.elastic.multiprocessing import api

    found = callable(getattr(api, HANDLER_NAME, None))
    return _replace(api, HANDLER_NAME, handler, found, "a second stop signal may cut the workers' close short")


def install_worker_entry(entry: Callable[..., None]) -> bool:
    """Make ``entry`` the function torchrun runs each worker through under ``--run-path``; False
    (and one line) where torch.distributed.run no longer names one."""
    from torch.distributed import run

    found = callable(getattr(run, WORKER_ENTRY_NAME, None)) and WORKER_ENTRY_NAME in _source_of(run.config_from_args)
    return _replace(run, WORKER_ENTRY_NAME, entry, found, "starting the workers as subprocesses", " for --run-path")


def _replace(module: ModuleType, name: str, value: object, found: bool, otherwise: str, role: str = "") -> bool:
    """Set ``module.name`` to ``value`` where ``found``; else one line saying what the agent does without it."""
    if not found:
        print(f"torchrun: {module.__name__} has no {name}{role} in this torch; {otherwise}", file=sys.stderr, flush=True)
        return False
    setattr(module, name, value)
    return True


def _source_of(function: Callable[..., object]) -> str:
    import inspect

    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""
