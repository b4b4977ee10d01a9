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
- the default disposition of every signal (the server ignores stop signals: below);
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

The server ignores SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2. SLURM signals every process of a
step, and a server that died of it would take its workers' exit codes with it (multiprocessing
reads them through the server: each would read 255), while it is only a fork factory that exits
when its agent does. The agent starts it with those signals ignored, a disposition that survives
the exec of its interpreter, and restores its own handlers at once.
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

import setproctitle

from purrsight.errors import SIGNAL_BASE
from purrsight.internals.python_exit import run_exit_handlers

# What train_phase2.py imports before its first step, its own top-level imports included:
# imported once, in the server.
PRELOAD = [
    "purrsight.launcher.forked_workers",  # run_worker, which each worker unpickles by name
    "purrsight.cli",
    "purrsight.config",
    "purrsight.distributed.process_group",
    "purrsight.training.run",
]
SERVER_IGNORES = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def asked_for(argv: list[str]) -> bool:
    """Whether torchrun's arguments ask for forked workers (``--run-path``, ``--start-method
    forkserver``): read before torch is imported, so the server's imports overlap the agent's."""
    script_at = next((i for i, arg in enumerate(argv) if arg.endswith(".py")), len(argv))
    options = argv[:script_at]  # torchrun's own, before the script's
    start_method = [b for a, b in itertools.pairwise(options) if a in ("--start-method", "--start_method")]
    start_method += [a.split("=", 1)[1] for a in options if a.startswith(("--start-method=", "--start_method="))]
    return any(a in ("--run-path", "--run_path") for a in options) and start_method[-1:] == ["forkserver"]


def start_server() -> None:
    """Start this process's fork server with the trainer's imports, its stop signals ignored.

    The imports begin now, in the server, while the caller goes on (torchrun's rendezvous)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    handlers = {stop: signal.signal(stop, signal.SIG_IGN) for stop in SERVER_IGNORES}
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for stop, handler in handlers.items():
            signal.signal(stop, handler)


def run_worker(script: str, *script_args: str) -> None:
    """One worker, in a process forked from the server: ``script`` as ``__main__`` with its arguments."""
    os.setsid()
    for stop in SERVER_IGNORES:
        signal.signal(stop, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh interpreter's: KeyboardInterrupt
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    for stream in (sys.stdout, sys.stderr):  # flushed at every line, as torchrun's ``python -u``: a log read live sees each
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` puts the script's folder first
    setproctitle.setproctitle(" ".join([sys.executable, "-u", script, *script_args]))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as end:
        if end.code not in (None, 0):
            raise  # multiprocessing makes it the process's exit code, as the interpreter would
    except KeyboardInterrupt:
        raise SystemExit(SIGNAL_BASE + signal.SIGINT) from None  # not a clean end: torch's wrapper would take it for one
    finally:
        run_exit_handlers()  # an interpreter's exit runs them; multiprocessing ends its children with os._exit
