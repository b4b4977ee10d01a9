"""One batch job's Ray node (python -m purrsight.ray_node start) with real Ray, outside any scheduler.

What a scheduler does to it is done by hand, as SLURM does it: SIGTERM to every process of the
node (a plain scancel, a preemption, qdel), then the batch script's teardown. The SLURM and PBS
tests (tests/cluster) run the same node inside real jobs; this one looks at it closely.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from purrsight.ray_node import processes
from purrsight.ray_node.ports import JobPorts
from tests.helpers import REPO, python_env
from tests.host_scan import SecretWatch, processes_using

JOB = "21090"
ADDRESS = "127.0.0.5"  # a loopback address of its own (the session's Ray cluster holds .2 and .3)
TOKEN = "prs-node-test-token-5e1f0c7a9d"
WANDB_KEY = "wandb-node-test-secret-77"

# A detached actor that starts a daemon as a library does (fork, setsid, fork again: the daemon
# is orphaned, and Ray's own cleanup, which kills a dead worker's children, cannot see it), which
# ignores SIGTERM. Both carry Ray's title (ray::Holder...); neither names the job's temp dir.
DRIVER = """
import os, sys, time, signal, ray
ray.init(address=sys.argv[1], namespace="prs-node-test", logging_level="ERROR")
if sys.argv[2] == "start":
    @ray.remote(num_cpus=0)
    class Holder:
        def start(self):
            read, write = os.pipe()
            if os.fork() == 0:
                os.setsid()
                daemon = os.fork()
                if daemon == 0:
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                    time.sleep(600)
                os.write(write, str(daemon).encode())
                os._exit(0)
            return os.getpid(), int(os.read(read, 32))
        def ping(self):
            return "pong"
    holder = Holder.options(name="holder", lifetime="detached").remote()
    print(*ray.get(holder.start.remote()), flush=True)
else:
    print(ray.get(ray.get_actor("holder").ping.remote()), flush=True)
"""


@pytest.fixture
def root() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="prs-n", dir="/tmp"))  # short: Ray's socket paths fit 107 bytes
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def node_env(root: Path) -> dict[str, str]:
    token = root / "auth-token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    env = python_env()
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
        env.pop(name, None)
    env.update(
        PATH=f"{REPO / '.venv' / 'bin'}:{env['PATH']}",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token),
        RAY_USAGE_STATS_ENABLED="0",
        WANDB_API_KEY=WANDB_KEY,
        OMP_NUM_THREADS="1",
    )
    return env


def ray_node(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "purrsight.ray_node", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def driver(env: dict[str, str], gcs: int, what: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, f"{ADDRESS}:{gcs}", what], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def title(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    return ""


def test_the_node_outlives_the_job_wide_sigterm_and_its_teardown_leaves_nothing(root: Path) -> None:
    """Ports probed (one taken by someone else: the node takes another), another user's folder at
    the temp dir's path left alone, the token on no command line. SIGTERM to every process of the
    node leaves Ray working (an actor still answers), as the driver needs it to checkpoint; the
    batch script's teardown then takes the whole tree down: the renamed actor and the helper it
    started as a daemon (orphaned: not below the actor any more), which ignores SIGTERM and names
    nothing of the job, included."""
    env = node_env(root)
    ports = JobPorts(int(ray_node(env, "ports", "--job", JOB).stdout))
    taken = ports.node(0)["--object-manager-port"]
    theirs = root / f"prs-{JOB}-0"
    theirs.mkdir()
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)
    else:
        theirs.rmdir()
        theirs.symlink_to("/")
    log = (root / "n0.log").open("w")
    args = ["start", "head", "--job", JOB, "--ports", str(ports.base), "--slot", "0", "--name", "n0", "--hint", ADDRESS]
    args += ["--temp-root", str(root), "--log-dir", str(root), "--teardown-file", str(root / ".teardown"), "--stop-grace", "120"]
    with socket.socket() as other, SecretWatch(lambda: [TOKEN, WANDB_KEY], lambda: [root]) as watch:
        other.bind(("127.0.0.1", taken))
        other.listen()
        node = subprocess.Popen([sys.executable, "-m", "purrsight.ray_node", *args], cwd=REPO, env=env, stdout=log, stderr=log)
        try:
            waited = ray_node(env, "wait", "--ports", str(ports.base), "--head", ADDRESS, "--nodes", "n0",
                              "--deadline", "150", "--watch", f"n0={node.pid}", "--log-dir", str(root))  # fmt: skip
            assert waited.returncode == 0, waited.stderr + (root / "n0.log").read_text()
            actor, helper = (int(pid) for pid in driver(env, ports.gcs, "start").split())
            assert title(actor).startswith("ray::Holder") and title(helper).startswith("ray::Holder")
            temp_prefix = f"{root}/prs-{JOB}-0-"  # the fresh folder beside the other user's
            seen = processes_using(temp_prefix)
            assert actor in seen and helper in seen, seen  # found by their open files, not their names

            tree = [node.pid, *processes.descendants(node.pid)]
            for pid in tree:  # the job-wide SIGTERM, as SLURM sends it to every process of a step
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            time.sleep(5)
            assert node.poll() is None and driver(env, ports.gcs, "ping") == "pong"  # Ray works on
            (root / ".teardown").touch()  # the batch script's teardown, as it reaches an ssh-started node
            assert node.wait(timeout=60) == 0
        finally:
            if node.poll() is None:  # a failed check: the tree below it first (SIGTERM is held there)
                for pid in processes.descendants(node.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                node.kill()
                node.wait()
            log.close()
    text = (root / "n0.log").read_text()
    assert f"port {taken} (--object-manager-port) is in use on n0: using " in text, text
    assert f"{theirs} is a " in text and "not this job's: leaving it" in text, text
    assert "SIGTERM: the job is stopping; Ray stays up until the batch script's teardown" in text
    assert "stopping this job's Ray on n0 (the batch script's teardown" in text
    left = {pid: title(pid) for pid in seen if title(pid) == seen[pid]}
    assert not left and not processes_using(temp_prefix), (left, processes_using(temp_prefix))
    assert not list(root.glob(f"prs-{JOB}-0-*")) and (theirs.is_symlink() or theirs.is_dir())
    watch.assert_clean({TOKEN, WANDB_KEY})
