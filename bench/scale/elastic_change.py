"""What a lost node and a node back cost an elastic job (`cluster_train.sh CONFIG 2:3 ...`), end to end.

Three launchers on loopback, one worker each (gloo, one thread), the tiny default with
``trainer.global_batch_size`` kept (12 samples a step: 3 x 2 x 2, then 2 x 2 x 3). Nothing is held
or planted: the job trains at its own pace, and the bench acts on what node 0's log says.

- a loss: once node 0 logs step ``--kill-at``, every process of node 1 is SIGKILLed at once (its
  launcher, torchrun's agent, the fork server, the worker). Read from node 0's step lines: the
  kill -> the first step after it; the steps trained again (the last step before the kill minus the
  checkpoint the two resumed from); samples/s over the ``--window`` steps before the kill and after
  the resume.
- a join: once the two log step ``--join-at``, node 1's launcher is started again (``RESUME=auto``).
  Read: its start -> the first step on three; the steps trained again (0 when the join's checkpoint
  is the resume's); samples/s over the window before its start and after the resume.

The three share this machine's cores, as two do after the loss: samples/s compares the worlds on
these cores, not a cluster's scaling (bench/scale/weak_scaling.py is that).

    .venv/bin/python -m bench.scale.elastic_change            # repository root
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import REPO, TINY_CONFIG, bench_env, ensure_synthetic_set, free_port, machine
from tests.helpers import rank0_steps  # (Unix time, step) of each step line; a step trained again appears twice
from tests.launcher.conftest import kill_whole

GLOBAL_BATCH, BATCH = 12, 2
RESUMED = re.compile(r"resuming from checkpoint .*step-(\d+)\.ckpt")


@dataclass
class Change:
    what: str
    to_training_s: float  # the kill, or the new launcher's start -> the first step after it
    steps_again: int  # steps trained before the change that the job trained again after it
    before_samples_s: float
    after_samples_s: float


def samples_per_s(lines: list[tuple[float, int]], window: int) -> float:
    """Over the last ``window`` steps of ``lines`` (consecutive steps of one world)."""
    (start, first), (end, last) = lines[-window - 1], lines[-1]
    return (last - first) * GLOBAL_BATCH / (end - start)


def wait_until(log: Path, done: Callable[[str], bool], timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if done(text):
            return text
        time.sleep(0.1)
    raise SystemExit(f"bench: timed out waiting on {log}")


class Job:
    def __init__(self, work: Path, steps: int) -> None:
        self.work, self.port, self.steps = work, free_port(), steps
        self.env = bench_env(NPROC_PER_NODE="1", BACKEND="gloo", RDZV_LAST_CALL_S="4", LOG_DIR=str(work / "logs"))
        self.launchers: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, node: int, **extra: str) -> float:
        overrides = [
            f"run.output_dir={self.work / 'runs'}", f"data.batch_size={BATCH}", f"trainer.global_batch_size={GLOBAL_BATCH}",
            f"trainer.max_steps={self.steps}", "checkpoint.every_n_steps=10", "checkpoint.keep_last=20",
            "trainer.val_every_n_steps=100000", "logging.progress=lines", "logging.every_n_steps=1",
        ]  # fmt: skip
        command = ["./cluster_train.sh", str(TINY_CONFIG), "2:3", str(node), "127.0.0.1", str(self.port), "--", *overrides]
        with (self.work / f"node{node}-{len(self.launchers)}.out").open("w") as out:
            started = time.time()
            self.launchers[node] = subprocess.Popen(
                command, cwd=REPO, env={**self.env, **extra}, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return started

    @property
    def log(self) -> Path:
        return self.work / "logs" / "latest_node0.log"

    def wait(self) -> None:
        codes = [launcher.wait(timeout=600) for launcher in self.launchers.values()]
        if codes != [0] * len(codes):
            raise SystemExit(f"bench: the launchers ended with {codes}; see {self.work}")


def resumed_after(log: Path, offset: int, window: int) -> tuple[str, re.Match[str]]:
    """The log once it holds, past ``offset``, a resume and ``window`` + 1 step lines after it; that resume."""
    text = wait_until(
        log, lambda text: (found := RESUMED.search(text, offset)) is not None and len(rank0_steps(text[found.end() :])) > window
    )
    resumed = RESUMED.search(text, offset)
    assert resumed is not None
    return text, resumed


def measure(work: Path, steps: int, kill_at: int, join_at: int, window: int) -> list[Change]:
    job = Job(work, steps)
    try:
        for node in (1, 2):  # the workers first: they wait for the master, and the three meet in one round
            job.start(node)
        time.sleep(2)
        job.start(0)
        before = wait_until(job.log, lambda text: any(step >= kill_at for _, step in rank0_steps(text)))
        killed = time.time()
        kill_whole(job.launchers.pop(1).pid)
        offset = len(before)
        after, resumed = resumed_after(job.log, offset, window)
        lost_lines = rank0_steps(after[resumed.end() :])
        loss = Change(
            "node 1 of 3 lost (SIGKILL, whole)",
            lost_lines[0][0] - killed,
            max(step for _, step in rank0_steps(after[: resumed.start()])) - int(resumed.group(1)),
            samples_per_s(rank0_steps(before), window),
            samples_per_s(lost_lines[: window + 1], window),
        )

        text = wait_until(job.log, lambda text: any(step >= join_at for _, step in rank0_steps(text[offset:])))
        started = job.start(1, RESUME="auto")
        offset_join = len(text)
        joined, resumed = resumed_after(job.log, offset_join, window)
        # The two train on until the join's stop lands (the step's end): their steps up to the
        # resume's line, and the three's after it.
        on_two, on_three = rank0_steps(joined[offset : resumed.start()]), rank0_steps(joined[resumed.end() :])
        join = Change(
            "node 1 back (RESUME=auto)",
            on_three[0][0] - started,
            max(step for _, step in on_two) - int(resumed.group(1)),
            samples_per_s(rank0_steps(joined[offset:offset_join]), window),  # before the new launcher took CPU
            samples_per_s(on_three[: window + 1], window),
        )
        job.wait()
        return [loss, join]
    finally:  # a bench that fails half way leaves no launcher training
        for launcher in job.launchers.values():
            if launcher.poll() is None:
                kill_whole(launcher.pid)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="the job's optimizer steps")
    parser.add_argument("--kill-at", type=int, default=45, help="node 1 is killed once node 0 logs this step")
    parser.add_argument("--join-at", type=int, default=150, help="node 1 starts again once the two log this step")
    parser.add_argument("--window", type=int, default=20, help="steps each samples/s is measured over")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--work", type=Path, help="the job's folder (logs, run), kept; a temporary one by default")
    args = parser.parse_args(argv)
    # Each samples/s needs `window` steps of one world: before the kill, between the resume and the
    # join, and after the join's resume.
    if args.window < 1:
        parser.error(f"--window {args.window}: must be at least 1")
    if args.kill_at <= args.window:
        parser.error(f"--kill-at {args.kill_at}: must exceed --window {args.window} (the steps measured before the kill)")
    if args.join_at <= args.kill_at + args.window:
        parser.error(f"--join-at {args.join_at}: must exceed --kill-at + --window = {args.kill_at + args.window}")
    if args.steps <= args.join_at + 2 * args.window:
        parser.error(f"--steps {args.steps}: must exceed --join-at + 2 x --window = {args.join_at + 2 * args.window}")
    ensure_synthetic_set()
    with tempfile.TemporaryDirectory(prefix="elastic-change-") as folder:
        work = args.work or Path(folder)
        work.mkdir(parents=True, exist_ok=True)
        changes = measure(work, args.steps, args.kill_at, args.join_at, args.window)
    print(machine())
    print()
    print("| change | to training again (s) | steps trained again | samples/s before | samples/s after |")
    print("|---|---|---|---|---|")
    for change in changes:
        print(
            f"| {change.what} | {change.to_training_s:.1f} | {change.steps_again} | "
            f"{change.before_samples_s:.1f} | {change.after_samples_s:.1f} |"
        )
    if args.json:
        args.json.write_text(json.dumps([asdict(change) for change in changes], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
