"""CPU seconds from exec to the first optimizer step of the tiny default, by phase, and what a node pays.

Three measures, each run ``--repeats`` times (medians):

1. **One trainer process, by phase**: a fresh interpreter runs the trainer (``training/run.py``'s
   ``train``, as ``train_phase2.py`` does) with marks at each phase's end, its own CPU seconds
   (user + system) at each: the interpreter's start, the imports, the config, building the model,
   data and trainer (to Lightning's ``setup``), Lightning's start (to ``on_train_start``, the
   preflight all-reduce included) and the first optimizer step.
2. **A node through the launcher**, per ``WORKER_START`` (subprocess: a fresh interpreter per
   worker, torchrun's default; forkserver: workers forked from a server that imported the
   trainer once, during the rendezvous) and per number of workers: launch -> the first step (wall)
   and the CPU seconds of the node's whole process tree until then, by part of the stack, and
   per worker process from its start (a fork or an exec) to the first step.
3. **A restart**: one worker SIGKILLed after step 10; torchrun restarts the node's workers, and
   the time and CPU seconds from the kill to the first step after it are measured, per mode.

    .venv/bin/python -m bench.launch.start_up --repeats 3          # from the repository root

The marks of measure 1 are taken in the measured process itself (``--child``), so it costs no
sampling error; measures 2 and 3 sample every process of the node every 0.1 s (bench/common.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import PYTHON, REPO, TINY_CONFIG, ProcessTreeCPU, bench_env, ensure_synthetic_set, free_port, machine

PHASES = ("interpreter", "imports", "config", "build", "Lightning start", "first step")
RESTART_KILL_AFTER = 10  # the step after which a worker is killed in measure 3


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child(overrides: list[str]) -> None:
    """Measure 1, inside the measured process: its CPU seconds at each phase's end, as JSON."""
    marks = {"interpreter": cpu_s()}
    import pytorch_lightning as pl

    from purrsight.config import load_config
    from purrsight.training.run import train

    marks["imports"] = cpu_s()
    config = load_config(TINY_CONFIG, overrides)
    marks["config"] = cpu_s()

    class Marks(pl.Callback):
        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            marks.setdefault("build", cpu_s())

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            marks.setdefault("Lightning start", cpu_s())

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            marks.setdefault("first step", cpu_s())

    train(config, callbacks=[Marks()])
    print("MARKS " + json.dumps(marks), flush=True)


def tiny_overrides(work: Path, steps: int, name: str) -> list[str]:
    return [
        f"run.output_dir={work / 'runs'}",
        f"run.name={name}",
        f"trainer.max_steps={steps}",
        "trainer.val_every_n_steps=100000",
        "checkpoint.every_n_steps=100000",
        "logging.progress=lines",
        "logging.every_n_steps=1",
        "telemetry.enabled=false",
    ]


def one_process(work: Path) -> dict[str, float]:
    """Measure 1: each phase's own CPU seconds in a fresh trainer process."""
    overrides = tiny_overrides(work, 1, f"one-{time.time_ns()}")
    done = subprocess.run(
        [PYTHON, "-m", "bench.launch.start_up", "--child", *overrides],
        cwd=REPO, env=bench_env(), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("MARKS ")]
    if done.returncode or not lines:
        raise SystemExit(f"bench: the trainer failed:\n{done.stderr[-3000:]}")
    marks = json.loads(lines[0].split(" ", 1)[1])
    at = [marks[phase] for phase in PHASES]
    return {phase: at[i] - (at[i - 1] if i else 0.0) for i, phase in enumerate(PHASES)}


def first_step_seen(log: Path, after: int = 0, restarted: bool = False) -> bool:
    """Rank 0 has logged a step (``step N/`` with every_n_steps 1) in the log past offset ``after``;
    with ``restarted``, a step after the restarted workers' resume line."""
    try:
        text = log.read_text(errors="replace")[after:]
    except FileNotFoundError:
        return False
    if restarted:
        text = text.partition("torchrun restart ")[2]
    return "purrsight.progress: step " in text


class NodeRun:
    """The tiny default through cluster_train.sh on one node, its process tree sampled every 0.1 s."""

    def __init__(self, work: Path, mode: str, nproc: int, steps: int, restarts: int = 0) -> None:
        name = f"{mode}-{nproc}-{time.time_ns()}"
        self.log = work / f"{name}.out"
        command = ["bash", str(REPO / "cluster_train.sh"), str(TINY_CONFIG), "1", "0", "127.0.0.1", str(free_port())]
        command += ["--", *tiny_overrides(work, steps, name)]
        env = bench_env(
            NPROC_PER_NODE=str(nproc), BACKEND="gloo", LOG_DIR=str(work / "logs"), WORKER_START=mode, MAX_RESTARTS=str(restarts)
        )
        self.cpu = ProcessTreeCPU(interval=0.1)
        self.cpu.__enter__()
        self.launched = time.monotonic()
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.cpu.watch(self.proc.pid)

    def wait_for_step(self, after: int = 0, restarted: bool = False, timeout: float = 300) -> float:
        """Until rank 0 logs a step (past offset ``after``; after a restart's resume line); the monotonic time then."""
        deadline = time.monotonic() + timeout
        while not first_step_seen(self.log, after, restarted):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"bench: no step in {self.log}:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)
        self.cpu.sample()
        return time.monotonic()

    def workers(self) -> list[tuple[int, float]]:
        """(pid, CPU s) of the training processes seen (their command line names train_phase2.py)."""
        return [(pid, seconds) for (pid, _), (role, seconds) in self.cpu.seen.items() if role == "worker"]

    def finish(self) -> None:
        try:
            self.proc.wait(timeout=300)
        finally:
            self.proc.kill()
            self.cpu.__exit__(None, None, None)


def node_start(work: Path, mode: str, nproc: int) -> dict[str, float]:
    """Measure 2: launch -> first step, and the node's CPU seconds until then."""
    run = NodeRun(work, mode, nproc, steps=3)
    seen_at = run.wait_for_step()
    by_role = run.cpu.by_role()
    workers = run.workers()
    run.finish()
    return {
        "first step (s)": seen_at - run.launched,
        "node CPU (s)": sum(by_role.values()),
        "workers' CPU (s)": by_role["worker"],
        "fork server CPU (s)": by_role["worker fork server"],
        "per worker (s)": statistics.mean(seconds for _, seconds in workers),
    }


def restart(work: Path, mode: str) -> dict[str, float]:
    """Measure 3: a worker SIGKILLed after step 10 of 2; kill -> the first step of the restarted workers."""
    run = NodeRun(work, mode, 2, steps=40, restarts=1)
    deadline = time.monotonic() + 300
    while f"step {RESTART_KILL_AFTER}/" not in run.log.read_text(errors="replace"):
        if run.proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"bench: never reached step {RESTART_KILL_AFTER}: {run.log}")
        time.sleep(0.05)
    run.cpu.sample()
    before = sum(run.cpu.by_role().values())
    offset = len(run.log.read_text(errors="replace"))
    victim = max(pid for pid, _ in run.workers())
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    seen_at = run.wait_for_step(after=offset, restarted=True)
    after = sum(run.cpu.by_role().values())
    run.finish()
    return {"kill -> first step (s)": seen_at - killed, "node CPU (s)": after - before}


def median_table(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def print_table(title: str, columns: list[str], rows: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}\n")
    print("| run | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[column]:.2f}" for column in columns) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.add_argument("--skip-restart", action="store_true", help="measures 1 and 2 only")
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
        return 0
    ensure_synthetic_set()
    print(machine())
    with tempfile.TemporaryDirectory(prefix="bench-start-") as tmp:
        work = Path(tmp)
        phases = median_table([one_process(work) for _ in range(args.repeats)])
        print(f"\nOne trainer process, CPU seconds by phase (median of {args.repeats})\n")
        print("| phase | CPU s |\n|---|---|")
        for phase, seconds in phases.items():
            print(f"| {phase} | {seconds:.2f} |")
        print(f"| **exec -> first step** | **{sum(phases.values()):.2f}** |")
        starts: dict[str, list[dict[str, float]]] = {}
        for repeat in range(args.repeats):
            runs = [(mode, nproc) for nproc in (1, 2) for mode in ("subprocess", "forkserver")]
            for mode, nproc in runs[repeat % len(runs) :] + runs[: repeat % len(runs)]:  # each first in turn
                starts.setdefault(f"{mode}, {nproc} worker(s)", []).append(node_start(work, mode, nproc))
        print_table(
            f"A node through the launcher: launch -> first step (median of {args.repeats})",
            ["first step (s)", "node CPU (s)", "workers' CPU (s)", "fork server CPU (s)", "per worker (s)"],
            {name: median_table(rows) for name, rows in starts.items()},
        )
        if not args.skip_restart:
            modes = ("subprocess", "forkserver")
            restarts = {mode: median_table([restart(work, mode) for _ in range(args.repeats)]) for mode in modes}
            title = "A worker SIGKILLed, 2 workers: kill -> first step after the restart"
            print_table(title, ["kill -> first step (s)", "node CPU (s)"], restarts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
