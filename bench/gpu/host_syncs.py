"""Host synchronisations per training step, counted on a CPU (tests/host_syncs.py says how).

    python -m bench.gpu.host_syncs [--steps N] [--step K] [OVERRIDE ...]   # e.g. trainer.precision=bf16-mixed

Trains the tiny default config in this process, inside a one-rank gloo process group so that
the collectives of a multi-rank run (the stop vote) run too, and counts the syncing calls made
between the start of batch K and the start of batch K+1 (K is not a logging, checkpoint,
telemetry or validation step). Prints each call with the code that made it, then the totals.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tests.host_syncs import count_step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--step", type=int, default=12, help="the counted step (1-based); not a multiple of 5 or 10")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. trainer.precision=bf16-mixed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        counter = count_step(Path(tmp), args.steps, args.step, args.overrides)
    print(counter.report())
    print(
        f"step {args.step}: {counter.total()} syncing call(s), {sum(counter.device_reads().values())} "
        "of them not the optimizer's host-side step counters"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
