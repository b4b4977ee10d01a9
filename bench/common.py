"""What the CPU benchmarks share: the machine, the runs they time, and how a run is read.

A *timed run* starts a command and notes the wall clock just before; the trainer (its
telemetry CSV) or the plain loop (its JSON) notes the wall clock after given optimizer
steps. From those: launch -> first optimizer step, and samples/s over a window of steps
that holds no validation and no checkpoint (both happen only at the last step).
"""

from __future__ import annotations

import csv
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.process_cpu import ProcessTreeCPU

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
TINY_CONFIG = REPO / "config" / "train_config.yaml"
WINDOW_START = 20  # steps before this are warm-up (allocator, first-touch, loader start)
ROW_EVERY = 10  # telemetry.every_n_steps in every timed run


@dataclass(frozen=True)
class Timing:
    first_step_s: float  # launch -> end of the first optimizer step
    samples_per_s: float  # global, over steps WINDOW_START .. last - ROW_EVERY


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def machine() -> str:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in line),
        platform.processor() or "unknown CPU",
    )
    import torch

    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {memory_gib:.0f} GiB; Python {platform.python_version()}, torch {torch.__version__}"


def steps_overrides(steps: int, run_dir: Path, per_process_batch: int) -> list[str]:
    """The tiny default with validation and checkpoints only at the last step, telemetry every ROW_EVERY."""
    return [
        f"run.output_dir={run_dir}",
        f"trainer.max_steps={steps}",
        f"trainer.val_every_n_steps={steps}",
        f"checkpoint.every_n_steps={steps}",
        f"telemetry.every_n_steps={ROW_EVERY}",
        f"data.batch_size={per_process_batch}",
    ]


def bench_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"  # one core per process in every run: the runs differ only in what they measure
    env["PATH"] = f"{Path(PYTHON).parent}:{env['PATH']}"
    env.update(extra)
    return env


def timed(command: list[str], env: dict[str, str], log: Path, cpu: ProcessTreeCPU | None = None) -> float:
    """Run ``command`` to completion (output to ``log``); return its launch time (Unix seconds).

    With ``cpu``, the CPU time of the command's process tree is sampled into it.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        launched = time.time()
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        if cpu is not None:
            cpu.watch(proc.pid)
        try:
            returncode = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise SystemExit(f"bench: {command[0]} ... still running after 600 s; see {log}") from None
    if returncode != 0:
        raise SystemExit(f"bench: {command[0]} ... failed with exit code {returncode}; see {log}")
    return launched


def timing_from_step_times(launched: float, step_times: dict[int, float], steps: int, global_batch: int) -> Timing:
    end = steps - ROW_EVERY
    window = step_times[end] - step_times[WINDOW_START]
    return Timing(step_times[1] - launched, (end - WINDOW_START) * global_batch / window)


def telemetry_step_times(run_dir: Path) -> dict[int, float]:
    """Step -> wall time of the rows node 0's telemetry wrote (step 1, then every ROW_EVERY).

    A row still being written (read while the run goes on) has no time yet and is left out.
    """
    with (run_dir / "telemetry" / "node0.csv").open() as file:
        return {int(float(row["step"])): float(row["time"]) for row in csv.DictReader(file) if row.get("time")}


def plain_step_times(path: Path) -> dict[int, float]:
    return {int(step): t for step, t in json.loads(path.read_text()).items()}


def median_timing(timings: list[Timing]) -> Timing:
    return Timing(
        statistics.median(t.first_step_s for t in timings),
        statistics.median(t.samples_per_s for t in timings),
    )


def run_stack(
    nproc: int,
    steps: int,
    per_process_batch: int,
    work: Path,
    name: str,
    launcher: bool = True,
    extra: tuple[str, ...] = (),
    launcher_env: dict[str, str] | None = None,
    cpu: ProcessTreeCPU | None = None,
) -> Timing:
    """The tiny default through cluster_train.sh (or torchrun + train_phase2.py when ``launcher`` is off).

    ``launcher_env``: further launcher variables (MONITOR_INTERVAL=...); ``cpu``: sample the run's CPU time into it.
    """
    run_name = f"{name}-{time.time_ns()}"
    overrides = [*steps_overrides(steps, work / "runs", per_process_batch), f"run.name={run_name}", *extra]
    port = free_port()
    if launcher:
        command = ["bash", str(REPO / "cluster_train.sh"), str(TINY_CONFIG), "1", "0", "127.0.0.1", str(port), "--", *overrides]
        env = bench_env(NPROC_PER_NODE=str(nproc), BACKEND="gloo", LOG_DIR=str(work / "logs"), **(launcher_env or {}))
    else:
        command = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        command += [str(REPO / "train_phase2.py"), "--config", str(TINY_CONFIG), *overrides]
        env = bench_env()
    launched = timed(command, env, work / "logs" / f"{run_name}.out", cpu)
    return timing_from_step_times(launched, telemetry_step_times(work / "runs" / run_name), steps, nproc * per_process_batch)


def run_plain(nproc: int, steps: int, per_process_batch: int, work: Path, cpu: ProcessTreeCPU | None = None) -> Timing:
    """bench/plain_ddp.py under plain torchrun: the same model, data, batch and optimizer, no Lightning."""
    out = work / f"plain-{time.time_ns()}.json"
    command = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command += ["-m", "bench.plain_ddp", "--steps", str(steps), "--batch-size", str(per_process_batch)]
    command += ["--out", str(out)]
    launched = timed(command, bench_env(), work / "logs" / f"{out.stem}.out", cpu)
    return timing_from_step_times(launched, plain_step_times(out), steps, nproc * per_process_batch)
