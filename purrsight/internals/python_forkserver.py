"""CPython's multiprocessing fork server, as a module it preloads sees it (written against CPython
3.11; the same names since 3.4).

``multiprocessing.forkserver.main`` imports the preload list, then forks one child per request,
which runs ``_serve_one``. So a module imported by a server's preload runs under ``main`` and not
under ``_serve_one``; in a fork of that server, anything imported later runs under both (the
launcher's workers are such forks, and a whole trainer runs in them). ``in_preload`` tells them
apart by those two names on the stack: data/loader_fork_server.py and launcher/forked_workers.py
act only in their server's preload (they hold stop signals, which a trainer must never do).
Guarded: where either name is missing, ``in_preload`` says so in one line and returns False:
the servers then keep the default signals (a stop may end a loader server or a worker server
with its workers, as before these modules existed), and no trainer ever holds them.

Each child of a server first runs ``multiprocessing.spawn.prepare``, which runs the parent's
``__main__`` script again (``_fixup_main_from_path``, or ``_fixup_main_from_name`` for ``python
-m``) as ``__mp_main__``, so that objects pickled from ``__main__`` can be found.
``skip_main_in_children`` makes a server's children skip it, for a server whose tasks live in
importable modules only. A process has one fork server (``multiprocessing.forkserver``'s module
state), whatever asked for it: in a trainer that is the loader's, so any other forkserver child a
trainer started would skip ``__main__`` too (none does; from Python 3.14 forkserver is Linux's
default start method, so a library's default ``Process`` or ``Pool`` in a trainer would be one).
"""

from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.spawn
import os
import sys
import traceback

SERVER_LOOP, CHILD = "main", "_serve_one"
MAIN_FIXUPS = ("_fixup_main_from_path", "_fixup_main_from_name")


def in_preload() -> bool:
    """Whether the caller is being imported by a fork server's preload (not in a fork of one)."""
    if not all(callable(getattr(multiprocessing.forkserver, name, None)) for name in (SERVER_LOOP, CHILD)):
        print(
            f"multiprocessing.forkserver has no {SERVER_LOOP} or {CHILD} in this Python: fork servers keep the default signals",
            file=sys.stderr,
            flush=True,
        )
        return False
    here = {(os.path.basename(frame.filename), frame.name) for frame in traceback.extract_stack()}
    return ("forkserver.py", SERVER_LOOP) in here and ("forkserver.py", CHILD) not in here


def skip_main_in_children() -> bool:
    """This server's children no longer run the parent's ``__main__`` before their task; whether
    that could be done (where this Python names the fix-ups otherwise, one line says so and the
    children run it as multiprocessing does)."""
    if not all(callable(getattr(multiprocessing.spawn, name, None)) for name in MAIN_FIXUPS):
        print(
            f"multiprocessing.spawn has no {' or '.join(MAIN_FIXUPS)} in this Python: "
            "a fork server's children run the parent's __main__ again",
            file=sys.stderr,
            flush=True,
        )
        return False
    for name in MAIN_FIXUPS:
        setattr(multiprocessing.spawn, name, _keep_this_main)
    return True


def _keep_this_main(_main: str) -> None:
    """In place of multiprocessing's fix-up: the child keeps the server's ``__main__``."""
