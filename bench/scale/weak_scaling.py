"""Weak scaling on CPU: the whole stack with 1 and then 2 processes, the same batch per process.

Efficiency = global samples/s with 2 processes / (2 x samples/s with 1). Every process has
one thread (OMP_NUM_THREADS=1) and, on a 2-core machine, a core of its own. The 1-process
run trains without DDP (Lightning's single-device strategy), as a 1-GPU job would; so the
efficiency includes the gradient all-reduce (gloo, loopback) and DDP's bookkeeping. The
plain DDP loop of bench/launch/plain_ddp.py is measured the same way, as the machine's reference:
what two processes get on these cores without anything of ours.

    .venv/bin/python -m bench.scale.weak_scaling --repeats 5   # from the repository root

Target: efficiency >= 0.9.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.common import ensure_synthetic_set, machine, run_plain, run_stack


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=210, help="optimizer steps per run (window: 20 .. steps-10)")
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    args = parser.parse_args()
    ensure_synthetic_set()
    rates: dict[str, list[float]] = {"stack 1": [], "stack 2": [], "plain 1": [], "plain 2": []}
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        work = Path(tmp)
        for repeat in range(args.repeats):
            for nproc in (1, 2):
                rates[f"stack {nproc}"].append(run_stack(nproc, args.steps, args.batch_size, work, f"n{nproc}").samples_per_s)
                rates[f"plain {nproc}"].append(run_plain(nproc, args.steps, args.batch_size, work).samples_per_s)
            print(f"repeat {repeat + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), flush=True)
    print(f"\nmachine: {machine()}")
    print(f"{args.repeats} repeats, {args.steps} steps, batch {args.batch_size} per process; medians\n")
    print("| run | 1 process (samples/s) | 2 processes (samples/s) | efficiency |")
    print("|---|---|---|---|")
    for name in ("stack", "plain"):
        one, two = rates[f"{name} 1"], rates[f"{name} 2"]
        efficiency = statistics.median(b / (2 * a) for a, b in zip(one, two, strict=True))
        print(f"| {name} | {statistics.median(one):.1f} | {statistics.median(two):.1f} | {efficiency:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
