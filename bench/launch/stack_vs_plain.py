"""Our whole stack against a plain PyTorch DDP loop: samples/s and launch -> first step.

Three ways to train the tiny default on 2 processes (gloo, CPU, one thread each), run in
turn ``--repeats`` times, medians reported:

- plain: torchrun + bench/launch/plain_ddp.py (same model, samples, batch, optimizer; no Lightning);
- trainer: torchrun + train_phase2.py (Lightning and our callbacks, no launcher);
- stack: cluster_train.sh -> torchrun -> train_phase2.py (its node plan: probe, config, health checks),
  once per ``--monitor-intervals`` value (the launcher's MONITOR_INTERVAL).

Every run's process tree is sampled for CPU seconds by part of the stack (workers,
torchrun's agent, the log writer, the launcher's other processes; bench/common.py).

    .venv/bin/python -m bench.launch.stack_vs_plain --repeats 5   # from the repository root

Targets: samples/s stack/plain >= 0.97; launch -> first step stack/plain <= 1.1 (issue 52; 1.3 before).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.common import (
    ROLES,
    ProcessTreeCPU,
    Timing,
    ensure_synthetic_set,
    machine,
    median_interval,
    median_timing,
    run_plain,
    run_stack,
)

RELIABLE_INTERVAL = 10  # repeats from which the median's interval is worth printing (bench.common.median_interval)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=110, help="optimizer steps per run (window: 20 .. steps-10)")
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--monitor-intervals", nargs="+", default=["1"], help="one stack run per MONITOR_INTERVAL value")
    parser.add_argument("--json", type=Path, help="also write the raw timings here")
    args = parser.parse_args()
    ensure_synthetic_set()
    runners: dict[str, Callable[[ProcessTreeCPU], Timing]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-stack-") as tmp:
        work = Path(tmp)
        runners["plain"] = lambda cpu: run_plain(2, args.steps, args.batch_size, work, cpu)
        runners["trainer"] = lambda cpu: run_stack(2, args.steps, args.batch_size, work, "trainer", launcher=False, cpu=cpu)

        def stack(interval: str) -> Callable[[ProcessTreeCPU], Timing]:
            env = {"MONITOR_INTERVAL": interval}
            return lambda cpu: run_stack(2, args.steps, args.batch_size, work, "stack", launcher_env=env, cpu=cpu)

        for interval in args.monitor_intervals:
            runners["stack" if len(args.monitor_intervals) == 1 else f"stack, monitor {interval} s"] = stack(interval)
        runs: dict[str, list[Timing]] = {name: [] for name in runners}
        cpu_s: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
        names = list(runners)
        for repeat in range(args.repeats):
            turn = repeat % len(names)
            for name in names[turn:] + names[:turn]:  # each run first in turn: no order bias
                with ProcessTreeCPU() as cpu:
                    runs[name].append(runners[name](cpu))
                cpu_s[name].append(cpu.by_role())
            print(f"repeat {repeat + 1}/{args.repeats}: " + "; ".join(f"{k} {v[-1]}" for k, v in runs.items()), flush=True)
    medians = {name: median_timing(timings) for name, timings in runs.items()}
    print(f"\nmachine: {machine()}")
    print(f"{args.repeats} repeats, {args.steps} steps, 2 processes x batch {args.batch_size}; medians")
    print("(ratios: the median of each repeat's ratio; a repeat runs them back to back, each first in turn;")
    print("the interval: a 90% percentile bootstrap of the median, shown from")
    print(f"{RELIABLE_INTERVAL} repeats on: over fewer it is little more than the ratios' own range)\n")
    print("| run | launch -> first step (s) | ratio to plain | samples/s | ratio to plain | its 90% interval |")
    print("|---|---|---|---|---|---|")
    for name, m in medians.items():
        start_ratio = statistics.median(t.first_step_s / p.first_step_s for t, p in zip(runs[name], runs["plain"], strict=True))
        rate_ratios = [t.samples_per_s / p.samples_per_s for t, p in zip(runs[name], runs["plain"], strict=True)]
        interval = "-"
        if len(rate_ratios) >= RELIABLE_INTERVAL:
            low, high = median_interval(rate_ratios)
            interval = f"{low:.3f} - {high:.3f}"
        print(
            f"| {name} | {m.first_step_s:.2f} | {start_ratio:.2f} | {m.samples_per_s:.1f} | "
            f"{statistics.median(rate_ratios):.3f} | {interval} |"
        )
    print("\nCPU seconds per run, by part (medians):\n")
    print("| run | " + " | ".join(ROLES) + " |")
    print("|---|" + "---|" * len(ROLES))
    for name, samples in cpu_s.items():
        print(f"| {name} | " + " | ".join(f"{statistics.median(s[role] for s in samples):.2f}" for role in ROLES) + " |")
    if args.json:
        raw = {k: {"timings": [t.__dict__ for t in v], "cpu_s": cpu_s[k]} for k, v in runs.items()}
        args.json.write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
