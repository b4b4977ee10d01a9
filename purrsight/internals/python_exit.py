"""CPython's ``atexit._run_exitfuncs`` (written against CPython 3.11; present since 3.0).

An interpreter that ends runs the handlers registered with ``atexit``; a child process of
multiprocessing ends with ``os._exit`` after its function and runs none of them. The launcher's
forked workers (launcher/forked_workers.py) are such children, and the trainer relies on its exit
handlers: the attempt record writes the process's end from one (runs/attempts.py), logging flushes
its handlers from one, and trackers' clients close from theirs. ``run_exit_handlers`` runs them
where the script ends, as the interpreter would have. Guarded: where the function is absent (another
Python), it says so in one line and the handlers do not run, as in any multiprocessing child.
"""

from __future__ import annotations

import atexit
import sys

NAME = "_run_exitfuncs"


def run_exit_handlers() -> bool:
    """Run (and clear) this process's atexit handlers; False, and one line, where this Python cannot."""
    run = getattr(atexit, NAME, None)
    if not callable(run):
        print(f"this Python's atexit has no {NAME}: a forked worker's exit handlers do not run", file=sys.stderr, flush=True)
        return False
    run()
    return True
