"""The Ray engine against torchrun: samples/s, submit -> first step, and a restart's cost.

The same model, data, batch and 2 processes (gloo, CPU, one thread each) both ways:

- torchrun: ``torchrun --nproc-per-node 2 train_phase2.py`` (no launcher);
- ray: ``ray job submit --working-dir . -- python train_phase2.py --engine ray`` to a
  two-node Ray cluster on this machine (127.0.0.2 and 127.0.0.3, one worker each, token
  auth on), started once by this script and stopped by pid at the end.

Each repeat runs both, each first in turn. Start-up is broken into phases from the
milliseconds of the log lines. With ``--restart``, one more run of each is killed with
SIGKILL (one worker) after the step-30 checkpoint; the cost is the time from the kill to the
end of the first step after it.

    .venv/bin/python -m bench.launch.ray_vs_torchrun --repeats 3      # from the repository root

Target: samples/s ray/torchrun >= 0.97.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psutil

from bench.common import (
    PYTHON,
    REPO,
    TINY_CONFIG,
    Timing,
    bench_env,
    ensure_synthetic_set,
    free_port,
    machine,
    steps_overrides,
    telemetry_step_times,
    timing_from_step_times,
)
from tests.ray.cluster import RayCluster, submission_id

STAMP = re.compile(r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d{3})")
# Start-up phases: (name, the log line that ends it); each phase starts where the previous ends.
RAY_PHASES = [
    ("submit: upload, job server, driver start", "Ray engine driver for job"),
    ("driver: config, data, run folder, connect", "starting 2 Ray Train workers"),
    ("Ray: placement, worker processes, process group", "Ray Train worker 0 of 2"),
    ("ours in the worker: model, data, preflight", "training from step 0"),
]
TORCHRUN_PHASES = [
    ("torchrun: agent, rendezvous, worker start, imports", "process group ready"),
    ("ours in the worker: model, data, preflight", "training from step 0"),
]


def line_time(log: str, marker: str, after: float = 0.0) -> float:
    """Unix time of the first line holding ``marker`` stamped at or after ``after``."""
    for line in log.splitlines():
        found = STAMP.search(line)
        if marker in line and found:
            stamp = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
            if stamp >= after - 0.001:
                return stamp
    raise SystemExit(f"bench: no log line with {marker!r}")


def phases(log: str, launched: float, first_step: float, marks: list[tuple[str, str]]) -> dict[str, float]:
    out, start = {}, launched
    for name, marker in marks:
        end = line_time(log, marker, launched)
        out[name] = end - start
        start = end
    out["first optimizer step"] = first_step - start
    return out


def run_torchrun(work: Path, steps: int, batch: int, name: str, kill_after: int | None = None) -> tuple[Timing, dict[str, float]]:
    overrides = [*steps_overrides(steps, work / "runs", batch), f"run.name={name}", "logging.progress=lines"]
    if kill_after:
        overrides.append(f"checkpoint.every_n_steps={kill_after}")
    command = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1"]
    command += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    command += [str(REPO / "train_phase2.py"), "--config", str(TINY_CONFIG), *overrides]
    run_dir = work / "runs" / name
    launched = time.time()
    # As the launcher does: restarted workers hang on a rendezvous store shared with the agent (pytorch#135712).
    env = bench_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = kill_one(psutil.Process(proc.pid), "train_phase2.py", run_dir, kill_after) if kill_after else None
    log, _ = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"bench: torchrun run failed ({proc.returncode}):\n{log[-3000:]}")
    return measured(log, launched, run_dir, steps, 2 * batch, TORCHRUN_PHASES, killed)


def run_ray(
    cluster: RayCluster, work: Path, steps: int, batch: int, name: str, kill_after: int | None = None
) -> tuple[Timing, dict[str, float]]:
    overrides = [*steps_overrides(steps, Path("runs"), batch), f"run.name={name}", "logging.progress=lines"]
    overrides += [f"ray.shared_dir={work}", "ray.num_workers=2"]
    if kill_after:
        overrides.append(f"checkpoint.every_n_steps={kill_after}")
    run_dir = work / "runs" / name
    launched = time.time()
    submitted = cluster.submit(*overrides, no_wait=bool(kill_after))
    killed = None
    if kill_after:
        killed = kill_one(cluster.nodes[1], "RayTrainWorker", run_dir, kill_after)
        followed = cluster.job("logs", "--follow", submission_id(submitted.stdout + submitted.stderr), timeout=900)
        log = followed.stdout
    else:
        log = submitted.stdout + submitted.stderr
        if submitted.returncode != 0:
            raise SystemExit(f"bench: ray job failed:\n{log[-3000:]}")
    return measured(log, launched, run_dir, steps, 2 * batch, RAY_PHASES, killed)


def kill_one(root: psutil.Process, marker: str, run_dir: Path, after_step: int) -> float:
    """SIGKILL one training process under ``root`` once the step-``after_step`` checkpoint exists."""
    checkpoint = run_dir / "checkpoints" / f"step-{after_step:08d}.ckpt"
    deadline = time.monotonic() + 600
    while not checkpoint.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench: {checkpoint} never appeared")
        time.sleep(0.05)
    for process in root.children(recursive=True):
        try:
            if marker in " ".join(process.cmdline()):
                process.kill()
                return time.time()
        except psutil.NoSuchProcess:
            continue
    raise SystemExit(f"bench: no process matching {marker!r} to kill")


def measured(
    log: str, launched: float, run_dir: Path, steps: int, global_batch: int, marks: list[tuple[str, str]], killed: float | None
) -> tuple[Timing, dict[str, float]]:
    step_times = telemetry_step_times(run_dir)
    timing = timing_from_step_times(launched, step_times, steps, global_batch)
    if killed is None:
        return timing, phases(log, launched, step_times[1], marks)
    resumed = line_time(log, "training from step", killed)
    return timing, {"kill -> training resumed": resumed - killed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=110, help="optimizer steps per run (window: 20 .. steps-10)")
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--restart", action="store_true", help="also time a restart after kill -9 of one worker")
    args = parser.parse_args()
    ensure_synthetic_set()
    root = Path(tempfile.mkdtemp(prefix="bench-ray-", dir="/tmp"))
    cluster = RayCluster(Path(tempfile.mkdtemp(prefix="prs-ray-", dir="/tmp")))  # short: Ray's socket paths fit 107 bytes
    rates: dict[str, list[float]] = {"torchrun": [], "ray": []}
    starts: dict[str, list[dict[str, float]]] = {"torchrun": [], "ray": []}
    try:
        cluster.start()
        work = root / "work"  # ray.shared_dir: the same samples as torchrun's, outside any timed run
        shutil.copytree(REPO / "data" / "synthetic", work / "data" / "synthetic")
        runners = {
            "torchrun": lambda name: run_torchrun(work, args.steps, args.batch_size, name),
            "ray": lambda name: run_ray(cluster, work, args.steps, args.batch_size, name),
        }
        names = list(runners)
        for repeat in range(args.repeats):
            for name in names[repeat % 2 :] + names[: repeat % 2]:
                timing, phase = runners[name](f"{name}-{repeat}")
                rates[name].append(timing.samples_per_s)
                starts[name].append({"total": timing.first_step_s, **phase})
            print(f"repeat {repeat + 1}: " + "; ".join(f"{n} {rates[n][-1]:.1f} samples/s" for n in names), flush=True)
        restarts = {}
        if args.restart:
            restarts["torchrun"] = run_torchrun(work, args.steps, args.batch_size, "torchrun-killed", kill_after=30)[1]
            restarts["ray"] = run_ray(cluster, work, args.steps, args.batch_size, "ray-killed", kill_after=30)[1]
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(cluster.root, ignore_errors=True)
    ratios = [r / t for r, t in zip(rates["ray"], rates["torchrun"], strict=True)]
    print(f"\nmachine: {machine()}")
    print(f"{args.repeats} repeats, {args.steps} steps, 2 processes x batch {args.batch_size}; medians\n")
    print("| engine | samples/s | ratio to torchrun | launch -> first step (s) |")
    print("|---|---|---|---|")
    for name in names:
        ratio = statistics.median(ratios) if name == "ray" else 1.0
        total = statistics.median(s["total"] for s in starts[name])
        print(f"| {name} | {statistics.median(rates[name]):.1f} | {ratio:.3f} | {total:.2f} |")
    for name in names:
        print(f"\n{name}: launch -> first step, by phase (median s)\n")
        for step_name in starts[name][0]:
            print(f"- {step_name}: {statistics.median(s[step_name] for s in starts[name]):.2f}")
    for name, cost in restarts.items():
        print(f"\n{name} restart after kill -9 of one worker: " + ", ".join(f"{k} {v:.2f} s" for k, v in cost.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
