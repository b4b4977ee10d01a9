"""torchrun, as the launcher runs it: the same arguments and behaviour, without traceback walls.

- A failed job is one line per failed rank (each worker's own message is in the log above),
  not torchrun's traceback, and exits with the workers' documented reason (bad input 2, a
  cluster check 3, the watchdog 86) when one gave it.
- The agent stops once per job: torchelastic raises for every SIGTERM, and a second one during
  the workers' close (SLURM signals every process of a step) cut the close short and left
  torchrun hung at exit. Later signals are noted and ignored (internals/torch_elastic.py).
- The first node's agent holds the rendezvous store. When that node's job ends first (its
  watchdog fired, it failed, it was lost), or this node is cut off from it, the other agents
  say so in one line and go on
  collecting their own workers' codes, instead of dying with a traceback while those workers
  finish (internals/torch_elastic.py). Each store operation gives up after the rdzv-conf's
  ``store_op_timeout`` (the launcher's RDZV_STORE_TIMEOUT), not its ``read_timeout``, which
  stays the time a node waits for the first one to come. A rendezvous that cannot be completed (a restart after
  that, a node that never came) is one line, not a traceback, and the code of the workers' last
  failure where they had one (else torchrun's 1).
- A node waiting to join an elastic job gets a line on every present node: the agent stops its
  workers (SIGTERM: a checkpoint at the step's end) and starts them again with it. A node of an
  elastic job that goes silent (no keep-alives) gets a line too, and the workers are killed, to
  meet again without it at once (lost_nodes.py).
- Each rendezvous gets a line with torchelastic's own timing (docs/SCALING.md reads them):

    2026-11-23 05:21:40 [torchrun] rendezvous 0 done in 1.84 s

- With ``--run-path --start-method forkserver`` (the launcher's default) the workers are forked
  from a server that imported the trainer once, started before the rendezvous
  (forked_workers.py says what each worker gets).

    python -m purrsight.launcher.torchrun [torchrun arguments] train_phase2.py ...
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from types import FrameType
from typing import Any

from purrsight.launcher import forked_workers

if __name__ == "__main__" and forked_workers.asked_for(sys.argv[1:]):
    # First, before this agent imports torch (1.5 CPU-s): the server's imports of the trainer
    # (4 s) then run beside the agent's own and its rendezvous, not after them.
    forked_workers.start_server()

from torch.distributed.elastic import metrics
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousError
from torch.distributed.run import parse_args, parse_min_max_nnodes, run

from purrsight.errors import SIGNAL_BASE, ExitCode
from purrsight.internals.torch_elastic import (
    RENDEZVOUS_FAILURE_METRIC,
    RENDEZVOUS_METRIC,
    install_terminate_handler,
    install_worker_entry,
    limit_store_operations,
    watch_waiting_nodes,
    watch_worker_failures,
)
from purrsight.launcher.lost_nodes import LostNodeStop

TORCHRUN_FAILED = 1  # torchrun's own code for a failed worker group, kept for callers that read it


class RendezvousLog(metrics.MetricHandler):
    """Prints torchelastic's duration metric of each rendezvous round, done or failed (its failure
    metric comes just before the duration); drops every other metric."""

    def __init__(self) -> None:
        self.rounds = 0
        self.failed = False

    def emit(self, metric_data: metrics.MetricData) -> None:
        if metric_data.name.endswith(RENDEZVOUS_FAILURE_METRIC):
            self.failed = True
        if not metric_data.name.endswith(RENDEZVOUS_METRIC):
            return
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(metric_data.timestamp))
        seconds = metric_data.value / 1000
        outcome = f"failed after {seconds:.2f} s" if self.failed else f"done in {seconds:.2f} s"
        print(f"{stamp} [torchrun] rendezvous {self.rounds} {outcome}", file=sys.stderr, flush=True)
        self.rounds += 1
        self.failed = False


class StopOnce:
    """The termination handler torchelastic installs in each agent (internals/torch_elastic.py),
    raising torchelastic's SignalException for the first signal only."""

    def __init__(self) -> None:
        self.stopping: signal.Signals | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        received = signal.Signals(signum)
        if self.stopping is not None:
            # os.write, not print: the interrupted frame may be inside a write to stderr
            os.write(2, f"torchrun: {received.name} again while stopping on {self.stopping.name}: ignored\n".encode())
            return
        self.stopping = received
        raise SignalException(f"Process {os.getpid()} got signal: {received}", sigval=received)


class LastFailure:
    """The workers' failures in the agent's last failed check (internals/torch_elastic.py): the
    codes a job ends with when its restart then cannot meet the other nodes."""

    def __init__(self) -> None:
        self.failures: dict[int, ProcessFailure] = {}

    def __call__(self, result: Any) -> None:
        self.failures = dict(result.failures)


class LostStoreLine:
    """Says once, for the whole job, that the rendezvous store stopped answering: the node holding
    it has ended, or this node can no longer reach it (its network is cut)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.said = False

    def __call__(self, err: Exception) -> None:
        if self.said:
            return
        self.said = True
        print(
            f"torchrun: the rendezvous store at {self.endpoint} is gone: the job of the node holding it has ended "
            "(its log says why), or this node's network is cut (the watchdog names who it cannot reach); "
            "this node's workers go on until they end, and their code is this job's",
            file=sys.stderr,
            flush=True,
        )


def say_nodes_joining(count: int) -> None:
    """The agent restarts its workers for nodes waiting to join (an elastic job's MAX not reached)."""
    print(
        f"torchrun: {count} node(s) waiting to join: the workers stop with a checkpoint at their step's end "
        "and the group starts again with them",
        file=sys.stderr,
        flush=True,
    )


class WithoutTraceback(logging.Filter):
    """Keeps torchelastic's "failed (exitcode: N)" line, drops the traceback it attaches.

    Workers forked from the server are watched by torch.multiprocessing, whose failure torchelastic
    logs with ``logger.exception``: a wall of the agent's own frames for a worker that exited 2 on
    bad input. The worker's own message is in the log already; its rank and code follow below.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


def job_exit_code(worker_codes: list[int]) -> int:
    """The job's code from its workers' in the last attempt: the documented reason when one
    gave it (bad input, a cluster check, the watchdog), else torchrun's own 1.

    torchrun's failure records keep each failed worker's exit code (negative: killed by that
    signal); torchrun itself exits 1 whatever they were.
    """
    for reason in (ExitCode.USAGE, ExitCode.CLUSTER, ExitCode.WATCHDOG):
        if reason in worker_codes:
            return int(reason)
    return TORCHRUN_FAILED


def report_failures(failures: dict[int, ProcessFailure]) -> int:
    """One line per failed rank; the job's code from theirs."""
    for rank, failure in sorted(failures.items()):
        print(
            f"torchrun: rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) exited with code {failure.exitcode}",
            file=sys.stderr,
        )
    return job_exit_code([failure.exitcode for failure in failures.values()])


def rendezvous_reason(err: BaseException) -> str:
    """The error's first line and, where it wraps one ("See inner exception"), its cause's."""
    parts: list[str] = []
    current: BaseException | None = err
    while current is not None and len(parts) < 2:
        first = str(current).splitlines()[0] if str(current) else "no reason given"
        parts.append(f"{type(current).__name__}: {first}")
        current = current.__cause__
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    metrics.configure(RendezvousLog(), group="torchelastic")
    install_terminate_handler(StopOnce())
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(WithoutTraceback())
    args = parse_args(argv if argv is not None else sys.argv[1:])
    limit_store_operations()
    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    lost_nodes = LostNodeStop() if min_nodes < max_nodes else None  # elastic: go on without a silent node
    watch_waiting_nodes(LostStoreLine(args.rdzv_endpoint), say_nodes_joining, lost_nodes)
    last_failure = LastFailure()
    watch_worker_failures(last_failure, lost_nodes.checked if lost_nodes else None)
    if args.run_path and args.start_method == "forkserver":
        if install_worker_entry(forked_workers.run_worker):
            forked_workers.start_server()  # started already when run as a program; here when main() is called
        else:
            args.run_path = False  # a subprocess per worker, as torchrun starts them by default
    try:
        run(args)
    except ChildFailedError as err:
        return report_failures(err.failures)
    except RendezvousClosedError:
        print(f"torchrun: the job at {args.rdzv_endpoint} has ended (its rendezvous is closed): nothing to join", file=sys.stderr)
        return TORCHRUN_FAILED
    except RendezvousError as err:
        print(
            f"torchrun: the rendezvous at {args.rdzv_endpoint} failed ({rendezvous_reason(err)}); "
            "if the first node's job has ended, its log says why",
            file=sys.stderr,
        )
        # The workers failed first (their restart is what met the gone store): their code, not 1.
        return report_failures(last_failure.failures) if last_failure.failures else TORCHRUN_FAILED
    except SignalException as err:
        print(f"torchrun: stopped by {err.sigval.name}; the workers were asked to save and exit", file=sys.stderr)
        return SIGNAL_BASE + int(err.sigval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
