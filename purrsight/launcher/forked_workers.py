"""Workers forked from a preloaded server: the trainer's imports once per node, during the rendezvous.

A worker spends about 5 CPU-seconds importing torch, Lightning and transformers before it reads its
config (bench/launch/start_up.py). A node of 8 GPUs paid that 8 times over, and every restart (a
worker that failed, a node lost or back) paid it again on every node, while the rendezvous waited.

torchrun can run its workers as a function in processes of Python's multiprocessing instead of
a fresh interpreter each (``--run-path --start-method forkserver``). The launcher asks for that,
and ``purrsight.launcher.torchrun`` gives multiprocessing's fork server this preload list and
starts it at once: the server imports the trainer's modules while the agent rendezvouses, and
each worker, on the first start and on every restart, is a fork of it, ready to read its config.
Nothing runs in the server but imports (an OpenMP pool does not survive a fork).

A worker gets what torchrun's subprocess workers get (``run_worker``):

- a session of its own (torchrun starts those with ``start_new_session``): a terminal's Ctrl-C or
  a kill of the launcher's process group reaches the agent, which stops its workers itself;
- the default disposition of every signal (the server holds the stop signals: below);
- the agent's environment with torchrun's per-worker variables over it, and ``OMP_NUM_THREADS``
  applied to torch's thread pool (the server imported torch before it knew the value);
- its output flushed at every line, as ``python -u`` gives a subprocess worker its own;
- the script run as ``__main__`` with its arguments and its folder first on ``sys.path``, as
  ``python SCRIPT`` runs it;
- a subprocess worker's command line (``python -u SCRIPT ARGS``) as its title in ``ps``, ``top``
  and ``/proc/PID/cmdline``: a fork would show its server's, and operators find workers by it;
- the script's exit code as the process's (0 for a clean end, 130 for a KeyboardInterrupt), and
  its ``atexit`` handlers run where it ends (multiprocessing ends a child with ``os._exit``,
  which runs none: internals/python_exit.py).

- an uncaught exception's traceback on its stderr (the rank's log), then exit code 1, as an
  interpreter prints it (torch's multiprocessing wrapper would only pickle it to a file);
- Lightning's rank for its rank-zero-only output, from ``RANK`` (Lightning read it at import, in
  the server, where every worker would otherwise be rank 0 until the trainer resets it).

The server holds (blocks) SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2. SLURM signals every
process of a step, and a server that died of it would take its workers' exit codes with it
(multiprocessing reads them through the server: each would read 255), while it is only a fork
factory that exits when its agent does. The server blocks them itself as it imports this module
(``internals/python_forkserver.in_preload``), so a server multiprocessing starts again (after an OOM kill) is as immune as the
first. Blocked, not ignored: a fork starts with the mask but no pending signal, and a stop sent
to it before it has unblocked them (``os.register_at_fork``, at the fork itself) waits pending
and ends it then; an ignored one would be lost, and a worker still starting would run on until
torch's wrapper gave up on it and sent SIGKILL, 30 s later.

Unlike a subprocess worker's, a forked worker's children (its loader's fork server, a tracker's
helper) are not signalled by the agent with it: torchelastic ends a forked worker by its pid, not
its process group. They end with it: the loader's server by its parent-death signal
(data/loader_fork_server.py), its workers with their server, as DataLoader workers do.
"""

from __future__ import annotations

import io
import itertools
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import signal
import sys
import threading

from purrsight.errors import SIGNAL_BASE
from purrsight.internals.python_exit import run_exit_handlers
from purrsight.internals.python_forkserver import in_preload

# What train_phase2.py imports before its first step, its own top-level imports included:
# imported once, in the server.
PRELOAD = [
    "purrsight.launcher.forked_workers",  # run_worker, which each worker unpickles by name
    "purrsight.cli",
    "purrsight.config",
    "purrsight.distributed.process_group",
    "purrsight.training.run",
    "purrsight.training.first_use",  # what the first step would build: pandas, transformers' conversion table
]
SERVER_IGNORES = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)  # held by the server


def asked_for(argv: list[str]) -> bool:
    """Whether torchrun's arguments ask for forked workers (``--run-path``, ``--start-method
    forkserver``): read before torch is imported, so the server's imports overlap the agent's."""
    script_at = next((i for i, arg in enumerate(argv) if arg.endswith(".py")), len(argv))
    options = argv[:script_at]  # torchrun's own, before the script's
    start_method = [b for a, b in itertools.pairwise(options) if a in ("--start-method", "--start_method")]
    start_method += [a.split("=", 1)[1] for a in options if a.startswith(("--start-method=", "--start_method="))]
    return any(a in ("--run-path", "--run_path") for a in options) and start_method[-1:] == ["forkserver"]


def _default_stop_signals() -> None:
    """A fresh interpreter's dispositions, then the stop signals unblocked (one pending is delivered now)."""
    for stop in SERVER_IGNORES:
        signal.signal(stop, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SERVER_IGNORES)


if in_preload():  # the server's own import, not a fork's
    signal.pthread_sigmask(signal.SIG_BLOCK, SERVER_IGNORES)
    os.register_at_fork(after_in_child=_default_stop_signals)


def start_server() -> None:
    """Start this process's fork server with the trainer's imports (the server holds the stop
    signals from its first import on). The imports begin now, in the server, while the caller goes
    on (torchrun's rendezvous). Until the server has imported this module, it still has the
    caller's handlers: the agent's own SIGTERM arrives at the agent first, and its stop ends it."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()


def run_worker(script: str, *script_args: str) -> None:
    """One worker, in a process forked from the server: ``script`` as ``__main__`` with its arguments."""
    os.setsid()
    _default_stop_signals()  # done at the fork already; again for a server started without this module
    _lightning_rank_from_environment()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    for stream in (sys.stdout, sys.stderr):  # flushed at every line, as torchrun's ``python -u``: a log read live sees each
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` puts the script's folder first
    _set_title([sys.executable, "-u", script, *script_args])
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as end:
        if end.code not in (None, 0):
            raise  # multiprocessing makes it the process's exit code, as the interpreter would
    except KeyboardInterrupt:
        raise SystemExit(SIGNAL_BASE + signal.SIGINT) from None  # not a clean end: torch's wrapper would take it for one
    except Exception:
        sys.excepthook(*sys.exc_info())  # torch's wrapper would only pickle it into a file nobody reads
        raise SystemExit(1) from None
    finally:
        _exit_as_the_interpreter_does()


def _exit_as_the_interpreter_does() -> None:
    """Join non-daemon threads, then run the atexit handlers: the interpreter's order at its end,
    which multiprocessing's ``os._exit`` skips (internals/python_exit.py)."""
    shutdown = getattr(threading, "_shutdown", None)
    if callable(shutdown):
        shutdown()
    run_exit_handlers()


def _set_title(command: list[str]) -> None:
    """``command`` as this process's title (``ps``, ``/proc/PID/cmdline``), and its short name
    (``/proc/PID/comm``: ``top``, ``pgrep -x``) the interpreter's, as a subprocess worker has."""
    import setproctitle  # here, not at the top: the launcher imports this module for either worker start

    setproctitle.setproctitle(" ".join(command))
    setproctitle.setthreadtitle(os.path.basename(sys.executable))


def _lightning_rank_from_environment() -> None:
    """Lightning's rank-zero-only rank, which it read at import (in the server), from this worker's ``RANK``."""
    rank = int(os.environ.get("RANK", "0"))
    for module in (
        "lightning_utilities.core.rank_zero",
        "lightning_fabric.utilities.rank_zero",
        "pytorch_lightning.utilities.rank_zero",
    ):
        decorator = getattr(sys.modules.get(module), "rank_zero_only", None)
        if decorator is not None:
            decorator.rank = rank
