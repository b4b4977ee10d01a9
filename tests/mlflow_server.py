"""A real ``mlflow server`` on loopback for the tracker tests: sqlite store, its own process group."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from tests.launcher.conftest import wait_for


def start_mlflow(folder: Path, port: int, store: str = "sqlite") -> subprocess.Popen[bytes]:
    """The server on ``port``, healthy, with its store in ``folder`` (an existing store is reopened).

    ``store="file"``: MLflow's file store, which keeps every point it is sent; the SQL stores drop
    an exact repeat (same metric, step, value and time) as a duplicate key, so a point sent twice
    shows only there.
    """
    folder.mkdir(exist_ok=True)
    backend = f"sqlite:///{folder / 'mlflow.db'}" if store == "sqlite" else (folder / "store").as_uri()
    command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    command += ["--backend-store-uri", backend, "--default-artifact-root", str(folder / "artifacts")]
    # No job execution: tracking needs none, and the server would otherwise keep a job runner and
    # seven huey consumers polling (half a core, measured, for as long as it runs). The file store
    # is in maintenance mode: MLflow refuses it unless asked.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_ALLOW_FILE_STORE": "true"}
    with (folder / "server.log").open("a") as sink:
        server = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    assert wait_for(healthy, timeout=90, interval=0.2), (folder / "server.log").read_text()[-2000:]
    return server


def kill_server(server: subprocess.Popen[bytes]) -> None:
    """SIGKILL the server and its workers together, as when its machine dies (again: nothing)."""
    with contextlib.suppress(ProcessLookupError):  # killed already: a test's clean-up after a failure
        os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=30)
