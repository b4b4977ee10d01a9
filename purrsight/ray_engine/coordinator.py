"""A small actor shared by the driver and every worker of one job.

Ray Train has no channel for three things the torchrun engine gets from signals and exit
codes:

* a stop: ``ray job stop`` signals the driver only, and Train V2 runs the training
  function in a thread, where no signal handler can be installed. The driver records
  the signal here; each worker polls it and stops as after SIGTERM (checkpoint, exit).
* a user error: Ray retries every worker failure, also a bad sample or a refused run
  folder. The failing worker records the message here; a restarted worker group reads it
  and returns at once instead of training again, and the driver prints it and exits 2.
* worker starts: how many times each rank has started in this job, so a restart is
  known as one even before the first checkpoint was reported to Ray.
"""

from __future__ import annotations


class RunCoordinator:
    """Plain state; the driver makes it an actor with ``ray.remote(num_cpus=0)``."""

    def __init__(self) -> None:
        self._stop_signal: int | None = None
        self._user_error: list[str] | None = None
        self._starts: dict[int, int] = {}

    def request_stop(self, signum: int) -> None:
        if self._stop_signal is None:
            self._stop_signal = signum

    def stop_signal(self) -> int | None:
        return self._stop_signal

    def record_user_error(self, lines: list[str]) -> None:
        if self._user_error is None:  # the first is the cause; later ones are its echoes
            self._user_error = list(lines)

    def user_error(self) -> list[str] | None:
        return self._user_error

    def worker_started(self, rank: int) -> int:
        """Count a start of ``rank``; returns the number of its earlier starts in this job."""
        earlier = self._starts.get(rank, 0)
        self._starts[rank] = earlier + 1
        return earlier
