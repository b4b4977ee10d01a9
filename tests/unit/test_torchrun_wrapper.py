"""purrsight.launcher.torchrun: its rendezvous line, fed by torchelastic's own metrics API, and its exit code.

The launcher tests (tests/launcher/) see the line come out of a real torchrun; here the
handler's filtering and round count are checked through ``metrics.prof``, the decorator
torchelastic times its agent's ``_rendezvous`` with.
"""

from __future__ import annotations

import re

import pytest
from torch.distributed.elastic import metrics

from purrsight.launcher.torchrun import RendezvousLog, job_exit_code


class SimpleElasticAgent:  # the name torchelastic's metric carries: <class>._rendezvous.duration.ms
    @metrics.prof
    def _rendezvous(self) -> None:
        pass

    @metrics.prof
    def _start_workers(self) -> None:
        pass


def test_one_line_per_rendezvous_round_and_nothing_else(capsys: pytest.CaptureFixture[str]) -> None:
    metrics.configure(RendezvousLog(), group="torchelastic")
    try:
        agent = SimpleElasticAgent()
        agent._rendezvous()
        agent._start_workers()
        agent._rendezvous()
    finally:
        metrics.configure(metrics.NullMetricHandler(), group="torchelastic")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    for round_, line in enumerate(lines):
        assert re.fullmatch(rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d \[torchrun\] rendezvous {round_} done in \d+\.\d\d s", line)


def test_the_job_exit_code_is_the_workers_documented_reason() -> None:
    """torchrun's failure records carry each worker's code; a documented one becomes the job's."""
    assert job_exit_code([2, -15]) == 2  # bad input on one rank, the other stopped by torchrun
    assert job_exit_code([-15, 86]) == 86  # the watchdog
    assert job_exit_code([3]) == 3
    assert job_exit_code([-9, 1]) == 1  # killed, or a bug: torchrun's own 1
