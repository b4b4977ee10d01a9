"""Weak scaling on CPU: the whole stack with 1 and then 2 processes, the same batch per process.

Efficiency = global samples/s with 2 processes / (2 x samples/s with 1). Every process has
one thread (OMP_NUM_THREADS=1) and, on a 2-core machine, a core of its own. The 1-process
run trains without DDP (Lightning's single-device strategy), as a 1-GPU job would; so the
efficiency includes the gradient all-reduce (gloo, loopback) and DDP's bookkeeping.

    .venv/bin/python -m bench.weak_scaling --repeats 5   # from the repository root

Target: efficiency >= 0.9.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.common import machine, run_stack
from bench.stack_vs_plain import ensure_synthetic_set


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=210, help="optimizer steps per run (window: 20 .. steps-10)")
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    args = parser.parse_args()
    ensure_synthetic_set()
    one, two = [], []
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        for repeat in range(args.repeats):
            one.append(run_stack(1, args.steps, args.batch_size, Path(tmp), "one").samples_per_s)
            two.append(run_stack(2, args.steps, args.batch_size, Path(tmp), "two").samples_per_s)
            print(f"repeat {repeat + 1}/{args.repeats}: 1 process {one[-1]:.1f} samples/s, 2 processes {two[-1]:.1f}", flush=True)
    efficiency = statistics.median(b / (2 * a) for a, b in zip(one, two, strict=True))
    print(f"\nmachine: {machine()}")
    print(f"{args.repeats} repeats, {args.steps} steps, batch {args.batch_size} per process, cluster_train.sh; medians\n")
    print("| processes | samples/s | efficiency |")
    print("|---|---|---|")
    print(f"| 1 | {statistics.median(one):.1f} | 1 |")
    print(f"| 2 | {statistics.median(two):.1f} | {efficiency:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
