"""A node's `ray start` dies with its node process, SIGKILL included (purrsight/parent_death.py).

With the job's stop signals blocked, a Ray whose node process was SIGKILLed would live on, unknown
to the scheduler, holding its GPUs: `ray start` gets a parent-death SIGKILL, and Ray's own daemons
share its fate (Ray's kernel fate sharing under `--block`). Here `sleep` stands in for `ray start`:
what is tested is what this project sets on the process it starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.helpers import REPO

STARTER = """
import sys
from purrsight.ray_node.node import spawn_with_job_stop_held
child = spawn_with_job_stop_held(["sleep", "60"])
print(child.pid, flush=True)
child.wait()
"""


def test_the_process_a_node_starts_with_stop_signals_held_dies_when_the_node_process_is_killed() -> None:
    starter = subprocess.Popen([sys.executable, "-c", STARTER], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert starter.stdout is not None
    started = psutil.Process(int(starter.stdout.readline()))
    blocked = {signal.Signals(int(n)) for n in _blocked(started.pid)}
    assert {signal.SIGTERM, signal.SIGINT, signal.SIGHUP} <= blocked  # what it and its children inherit
    os.kill(starter.pid, signal.SIGKILL)
    starter.wait(timeout=10)
    deadline = time.monotonic() + 10
    while started.is_running() and started.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the started process outlived its starter's SIGKILL"
        time.sleep(0.05)


def test_the_nodes_ray_runs_in_a_session_of_its_own() -> None:
    """OpenPBS's MoM sends qdel's SIGTERM to each task's session, and Ray's dashboard (the job
    server) exits on it by a handler of its own: the node's Ray is started out of its session."""
    starter = "import sys\nfrom purrsight.ray_node.node import spawn_with_job_stop_held\n"
    starter += "child = spawn_with_job_stop_held(['sleep', '60'])\nprint(child.pid, flush=True)\nchild.wait()"
    node = subprocess.Popen([sys.executable, "-c", starter], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert node.stdout is not None
        started = int(node.stdout.readline())
        assert os.getsid(started) == started != os.getsid(node.pid)
    finally:
        node.kill()
        node.wait(timeout=10)


def _blocked(pid: int) -> list[int]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    mask = int(next(line for line in status if line.startswith("SigBlk:")).split()[1], 16)
    return [n for n in range(1, 65) if mask & (1 << (n - 1))]
