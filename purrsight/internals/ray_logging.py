"""Ray's internals behind the lines we keep out of a job log (written against Ray 2.60).

Ray offers no public hook for either, so both are guarded: where one has moved, the lines are
printed as before and training goes on.

- Ray Train's per-checkpoint INFO lines come from two loggers of ``ray.train.v2._internal``:
  the execution context's (named by its file's path) and the storage module's.
- A Ray driver prints every Ray process's output through a printer registered, by name, on
  ``ray._private.ray_logging.global_worker_stdstream_dispatcher``.
- The job SDK narrates uploads through loggers of ``ray._private.runtime_env``.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

PRINT_HANDLER = "ray_print_logs"  # the name ray.init gives its log_to_driver printer
RUNTIME_ENV_LOGGERS = ("ray._private.runtime_env.packaging", "ray._private.runtime_env.working_dir")


def train_report_loggers() -> tuple[logging.Logger, logging.Logger] | None:
    """Ray Train's (context, storage) loggers, which log each reported checkpoint; None where not found."""
    try:
        import ray.train.v2._internal.execution.context as context
        import ray.train.v2._internal.execution.storage as storage
    except ImportError as error:
        log.debug("Ray Train's report loggers not found (%s): their lines stay", error)
        return None
    return logging.getLogger(context.__file__), logging.getLogger(storage.__name__)  # context.py names its logger by its path


def stdstream_dispatcher() -> Any | None:
    """The dispatcher a Ray driver prints other processes' output through; None where not found."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher
    except ImportError:
        return None
    if not all(hasattr(global_worker_stdstream_dispatcher, name) for name in ("handlers", "add_handler", "remove_handler")):
        return None
    return global_worker_stdstream_dispatcher
