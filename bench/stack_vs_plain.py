"""Our whole stack against a plain PyTorch DDP loop: samples/s and launch -> first step.

Three ways to train the tiny default on 2 processes (gloo, CPU, one thread each), run in
turn ``--repeats`` times, medians reported:

- plain: torchrun + bench/plain_ddp.py (same model, samples, batch, optimizer; no Lightning);
- trainer: torchrun + train_phase2.py (Lightning and our callbacks, no launcher);
- stack: cluster_train.sh -> torchrun -> train_phase2.py (probe, config check, health checks).

    .venv/bin/python -m bench.stack_vs_plain --repeats 5   # from the repository root

Targets: samples/s stack/plain >= 0.97; launch -> first step stack/plain <= 1.3.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.common import TINY_CONFIG, Timing, machine, median_timing, run_plain, run_stack


def ensure_synthetic_set() -> None:
    """Generate the tiny default's data once, outside every timed run."""
    from purrsight.config import load_config
    from purrsight.data.synthetic import prepare_synthetic

    prepare_synthetic(load_config(TINY_CONFIG, check_paths=False))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=110, help="optimizer steps per run (window: 20 .. steps-10)")
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--json", type=Path, help="also write the raw timings here")
    args = parser.parse_args()
    ensure_synthetic_set()
    runs: dict[str, list[Timing]] = {"plain": [], "trainer": [], "stack": []}
    with tempfile.TemporaryDirectory(prefix="bench-stack-") as tmp:
        work = Path(tmp)
        runners: dict[str, Callable[[], Timing]] = {
            "plain": lambda: run_plain(2, args.steps, args.batch_size, work),
            "trainer": lambda: run_stack(2, args.steps, args.batch_size, work, "trainer", launcher=False),
            "stack": lambda: run_stack(2, args.steps, args.batch_size, work, "stack"),
        }
        names = list(runners)
        for repeat in range(args.repeats):
            for name in names[repeat % 3 :] + names[: repeat % 3]:  # each run first in turn: no order bias
                runs[name].append(runners[name]())
            print(f"repeat {repeat + 1}/{args.repeats}: " + "; ".join(f"{k} {v[-1]}" for k, v in runs.items()), flush=True)
    medians = {name: median_timing(timings) for name, timings in runs.items()}
    print(f"\nmachine: {machine()}")
    print(f"{args.repeats} repeats, {args.steps} steps, 2 processes x batch {args.batch_size}; medians")
    print("(ratios: the median of each repeat's ratio; a repeat runs the three back to back, each first in turn)\n")
    print("| run | launch -> first step (s) | ratio to plain | samples/s | ratio to plain |")
    print("|---|---|---|---|---|")
    for name, m in medians.items():
        start_ratio = statistics.median(t.first_step_s / p.first_step_s for t, p in zip(runs[name], runs["plain"], strict=True))
        rate_ratio = statistics.median(t.samples_per_s / p.samples_per_s for t, p in zip(runs[name], runs["plain"], strict=True))
        print(f"| {name} | {m.first_step_s:.2f} | {start_ratio:.2f} | {m.samples_per_s:.1f} | {rate_ratio:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({k: [t.__dict__ for t in v] for k, v in runs.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
