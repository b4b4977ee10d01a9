"""torchrun, as the launcher runs it: the same arguments and behaviour, without traceback walls.

torchrun ends a failed job by raising ChildFailedError (or SignalException when it is
stopped), which prints a Python traceback of torchrun's own internals into every node log
after the workers' one-line errors. Here the failure is summarised in one line per failed
rank instead; each worker's own message is already in the log above it.

    python -m purrsight.cluster.torchrun [torchrun arguments] train_phase2.py ...
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from purrsight.errors import SIGNAL_BASE

TORCHRUN_FAILED = 1  # torchrun's own code for a failed worker group, kept for callers that read it


def main(argv: list[str] | None = None) -> int:
    try:
        run(parse_args(argv if argv is not None else sys.argv[1:]))
    except ChildFailedError as err:
        for rank, failure in sorted(err.failures.items()):
            print(
                f"torchrun: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) exited with code {failure.exitcode}",
                file=sys.stderr,
            )
        return TORCHRUN_FAILED
    except SignalException as err:
        print(f"torchrun: stopped by {err.sigval.name}; the workers were asked to save and exit", file=sys.stderr)
        return SIGNAL_BASE + int(err.sigval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
