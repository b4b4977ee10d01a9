"""Start cluster_train.sh as real processes: each one a "node" on this machine (loopback)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.helpers import REPO, free_port, launcher_env, tiny_overrides


class Launcher:
    def __init__(self, proc: subprocess.Popen[str], output: Path) -> None:
        self.proc = proc
        self.output = output

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def text(self) -> str:
        return self.output.read_text(errors="replace")


class Cluster:
    """Several launchers sharing one master port, run folder and log folder."""

    def __init__(self, tmp: Path, synthetic_dir: Path) -> None:
        self.tmp = tmp
        self.synthetic_dir = synthetic_dir
        self.port = free_port()
        self.log_dir = tmp / "logs"
        self.run_dir = tmp / "runs" / "phase2-tiny"
        self.launchers: list[Launcher] = []

    def env(self, **extra: str) -> dict[str, str]:
        defaults = {
            "OMP_NUM_THREADS": "1",  # several "nodes" share two cores: oversubscription would crawl
            "RDZV_TIMEOUT": "120",
            "MAX_RESTARTS": "2",
        }
        return launcher_env(self.log_dir, **{**defaults, **extra})

    def start(
        self,
        num_nodes: int | str,
        node_rank: int,
        *,
        port: int | None = None,
        env: dict[str, str] | None = None,
        **overrides: object,
    ) -> Launcher:
        output = self.tmp / f"node{node_rank}-{len(self.launchers)}.out"
        args = [
            "./cluster_train.sh",
            "config/train_config.yaml",
            str(num_nodes),
            str(node_rank),
            "127.0.0.1",
            str(port or self.port),
            "--",
            *tiny_overrides(self.synthetic_dir, self.tmp / "runs", **overrides),
        ]
        with output.open("w") as sink:
            proc = subprocess.Popen(
                args,
                cwd=REPO,
                env=self.env(**(env or {})),
                stdout=sink,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        launcher = Launcher(proc, output)
        self.launchers.append(launcher)
        return launcher

    def node_log(self, node_rank: int) -> str:
        return (self.log_dir / f"latest_node{node_rank}.log").read_text(errors="replace")

    def stop_all(self) -> None:
        for launcher in self.launchers:
            if launcher.proc.poll() is None:
                os.killpg(launcher.proc.pid, 9)
                launcher.proc.wait()


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def kill_whole(pid: int) -> None:
    """SIGKILL to ``pid`` and every process under it at once: a node lost whole. Not a killpg: the
    launcher's forked workers have sessions of their own."""
    for doomed in [pid, *(process.pid for process in descendants(pid))]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(doomed, signal.SIGKILL)


def wait_for(predicate, timeout: float, interval: float = 0.5) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


# The last of a node's own health checks (purrsight/launcher/health.py): a worker node's next,
# "master reachable", waits for the master's rendezvous store.
OWN_CHECKS_PASSED = "health: PASS  output writable"


def wait_for_workers_at_the_master_check(workers: list[tuple[subprocess.Popen[Any], Path]], timeout: float = 120) -> None:
    """Until each worker node's launcher (its process, its console file) has passed its own health
    checks and waits for the master: a master started then has all of them join its first round,
    however long their preparation took. Fails at once, with their output, where one ends or fails
    a check (the master would wait for it in vain)."""

    def consoles() -> list[str]:
        return [console.read_text(errors="replace") for _, console in workers]

    def ended_or_failed() -> bool:
        return any(proc.poll() is not None for proc, _ in workers) or any("health: FAIL" in text for text in consoles())

    def ready() -> bool:
        return ended_or_failed() or all(OWN_CHECKS_PASSED in text for text in consoles())

    assert wait_for(ready, timeout), [text[-2000:] for text in consoles()]
    assert not ended_or_failed(), [text[-2000:] for text in consoles()]


@pytest.fixture
def cluster(tmp_path: Path, synthetic_dir: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path, synthetic_dir)
    yield cluster
    cluster.stop_all()
