"""The trainer's command line in forked children of one interpreter that has imported it already.

A trainer process spends about 10 CPU-seconds on this machine importing Lightning, torchmetrics
and torch before it reads its first argument; a bad-input case that ends at the index, the
checkpoint or the tracker's address pays that for one line of output, and a 20-step resume test
pays it for a second of training. Here one server process
imports ``train_phase2`` and the training stack once and forks a child per command. Each child
is its own process, with the environment, working directory, stdout, stderr and exit status the
command would have, and runs the same ``main()`` as ``python train_phase2.py`` (or
``python -m purrsight.config``), exit handlers included; only the interpreter start and the
imports are shared. What a fresh start alone can show stays a fresh start: every launcher and
torchrun job, a few bad-input cases (tests/bad_inputs), and the runs whose output is checked for
noise (a warning the imports print comes once, in the server, not in each child).

The server must not run torch before it forks (an OpenMP pool does not survive a fork), and
it does not: it only imports.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.helpers import REPO, python_env

ENTRY_POINTS = ("train_phase2", "purrsight.config")


class PreloadedTrainer:
    """A server (``python -m tests.preloaded``) that runs commands in forked children."""

    def __init__(self) -> None:
        self.server = subprocess.Popen(
            [sys.executable, "-m", "tests.preloaded"],
            cwd=REPO,
            env=python_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._reply(timeout=300)  # "ready" once the imports are done

    def run(
        self, entry: str, argv: list[str], env: dict[str, str], cwd: Path = REPO, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """``python train_phase2.py ARGV`` (entry "train_phase2") or ``python -m purrsight.config ARGV``."""
        assert entry in ENTRY_POINTS, entry
        with tempfile.TemporaryDirectory(prefix="preloaded-") as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            request = {"entry": entry, "argv": argv, "env": env, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
            assert self.server.stdin is not None
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            reply = self._reply(timeout)
            return subprocess.CompletedProcess(
                [entry, *argv], int(reply["returncode"]), out.read_text(errors="replace"), err.read_text(errors="replace")
            )

    def _reply(self, timeout: float) -> dict[str, Any]:
        assert self.server.stdout is not None
        ready, _, _ = select.select([self.server.stdout], [], [], timeout)
        line = self.server.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise RuntimeError(f"the preloaded trainer gave no answer in {timeout:.0f} s (exit {self.server.poll()})")
        return dict(json.loads(line))

    def close(self) -> None:
        if self.server.stdin is not None:
            self.server.stdin.close()
        try:
            self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()


def _child(request: dict[str, Any]) -> int:
    """In the forked child: become the command, run its main()."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if request["entry"] == "train_phase2":
        import train_phase2

        sys.argv = [str(REPO / "train_phase2.py"), *request["argv"]]
        return train_phase2.main(request["argv"])
    from purrsight.config import main as config_main

    sys.argv = [str(REPO / "purrsight" / "config.py"), *request["argv"]]  # as `python -m` sets it
    return config_main(request["argv"])


def serve() -> None:
    import purrsight.config
    import purrsight.training.first_use  # what a trainer builds at its first use, built here as in the launcher's server
    import purrsight.training.run  # noqa: F401  (Lightning, torchmetrics, torch, transformers)
    import train_phase2  # noqa: F401  (the imports every child shares)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            # The child leaves through SystemExit, as `python train_phase2.py` does: exit handlers
            # run and an unexpected exception prints its traceback and exits 1.
            raise SystemExit(_child(request))
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
