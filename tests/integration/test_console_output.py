"""What a user sees: a step bar on a terminal with log lines above it, and no noise in logs."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from tests.helpers import DEFAULT_CONFIG, REPO, free_port, launcher_env, noise_in, python_env, tiny_overrides

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (INFO|WARNING|ERROR) ")


def run_on_terminal(args: list[str], columns: int = 120, timeout: float = 300) -> tuple[int, str]:
    """Run ``args`` with stdout and stderr on a pseudo-terminal ``columns`` wide; (exit code, output)."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(args, cwd=REPO, env=python_env(), stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal)
    os.close(terminal)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([controller], [], [], 1.0)
        if ready:
            try:
                data = os.read(controller, 65536)
            except OSError:  # the terminal closed: every writer has exited
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(controller)
    if proc.poll() is None:
        proc.kill()
    return proc.wait(timeout=30), b"".join(chunks).decode(errors="replace")


def test_terminal_shows_one_step_bar_and_writes_lines_above_it(synthetic_dir: Path, tmp_path: Path) -> None:
    overrides = tiny_overrides(synthetic_dir, tmp_path, trainer__max_steps=30, logging__progress="auto")
    code, output = run_on_terminal([sys.executable, str(REPO / "train_phase2.py"), "--config", str(DEFAULT_CONFIG), *overrides])
    assert code == 0, output[-3000:]
    # Each redraw starts at a carriage return; a log line must start a segment of its own.
    segments = [ANSI.sub("", part) for part in re.split(r"[\r\n]", output) if ANSI.sub("", part).strip()]
    bars = [s for s in segments if s.startswith(("train:", "validating:"))]
    assert bars, output[-3000:]
    assert re.search(r"train: 100%\|.*\| 30/30 \[.*step/s, loss=[\d.]+, val_loss=[\d.]+, val_acc=[\d.]+\]", bars[-1]), bars[-1]
    assert any(s.startswith("validating:") for s in bars)
    logged = [s for s in segments if " INFO " in s]
    assert logged and all(LOG_LINE.match(s) for s in logged), [s for s in logged if not LOG_LINE.match(s)][:3]
    assert any("validation at step 30  val/accuracy" in s for s in logged)
    assert any("checkpoint saved:" in s for s in logged)
    assert noise_in(output) == []


@pytest.mark.parametrize("validation", [False, True])
def test_small_run_through_the_launcher_is_quiet(tmp_path: Path, validation: bool) -> None:
    """One rank through the launcher (torchrun with one worker, as on a laptop), with and
    without a validation set, on fewer batches per epoch than the logging interval: each used
    to print a warning on every run."""
    small = tmp_path / "small"
    val = {"trainer__val_every_n_steps": 6} if validation else {"data__val_index": "null"}
    overrides = tiny_overrides(small, tmp_path / "runs", data__synthetic__num_train=16, trainer__max_steps=12, **val)
    env = launcher_env(tmp_path / "logs", HEALTH_CHECKS="0", NPROC_PER_NODE="1", BACKEND="gloo")
    command = ["./cluster_train.sh", str(DEFAULT_CONFIG), "1", "0", "127.0.0.1", str(free_port()), "--", *overrides]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "step 10/12" in output  # the interval is counted across epochs (2 batches each)
    assert ("validation at step 12" in output) == validation
    assert noise_in(output) == []
    assert "Warning" not in output and "recommended" not in output, output[-3000:]
