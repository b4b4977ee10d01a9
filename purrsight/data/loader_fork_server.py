"""The loader workers' fork server's preload (training/datamodule.py): stop signals are the trainer's.

Imported there and nowhere else: nothing in purrsight imports this module. Importing it is what
makes a fork server hold and ignore SIGTERM and SIGINT, for the reasons below; a process that
imported it by mistake would never checkpoint on a stop, so it acts only inside a fork server's
preload, and the launcher's worker server (launcher/forked_workers.py), which preloads the whole
trainer, does not list it. Until 2026-11-27 it acted on any fork server's import and was
imported through loader_worker.py: the launcher's server then held SIGTERM for every worker it
forked, and no worker stopped on one.

A preemption's SIGTERM and a terminal's Ctrl-C reach the whole process group: the fork server
and the loader workers too. A worker that died of it, or whose fork server did (torch's workers
exit when the process that forked them is gone), failed the trainer with "DataLoader worker
exited unexpectedly" before it could save its stop checkpoint. Imported in the fork server,
this module makes the server ignore both signals, and the workers it forks inherit that, except
for the SIGTERM handler torch's worker loop installs (loader_worker.ignore_stop_signals undoes it,
as the worker's init function); the trainer finishes its step, saves, and its exit ends them.

The fork server also holds (blocks) both signals, and its workers are born with them held:
between a worker's start and its init function torch's worker loop installs a SIGTERM handler
that ends the worker, and a preemption's SIGTERM in that window killed a worker that was still
starting. The init function ignores them first, then releases them, which discards a held one.

And it dies with the trainer that started it (Linux's parent-death signal, SIGKILL). A fork server
exits when the process that started it is gone, but only once every child holding its "alive"
pipe has gone too, and torch's loader workers wait for their parent, the server, to go: a trainer
killed with SIGKILL (the OOM killer, a fault) left its server and loader workers running for good,
holding their shared-memory batches and whatever the trainer's output was (2026-11-27: under the
launcher's worker server, the node log's pipe, so the launcher never ended). With the server dead,
torch's workers see their parent change and exit within seconds.

And its workers do not run the trainer's ``__main__`` script again before their task, as
multiprocessing's children do (internals/python_forkserver.py): what a worker unpickles (the
dataset, the collator, the init function) lives in purrsight's modules, and a script that runs
the trainer imports the whole of it. A worker under Ray's ``default_worker.py`` imported Ray, one
under a test's probe script (Lightning at its top) took 2.4 CPU-s to start, 0.3 without
(2026-11-29).
"""

from __future__ import annotations

from purrsight.data.loader_worker import hold_stop_signals, ignore_stop_signals
from purrsight.internals.python_forkserver import in_preload, skip_main_in_children
from purrsight.parent_death import die_with_parent

if in_preload():  # the loader's server itself, never a trainer (which may run in a fork of the launcher's server)
    ignore_stop_signals()
    hold_stop_signals()
    die_with_parent()
    skip_main_in_children()
