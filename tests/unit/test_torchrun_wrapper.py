"""purrsight.cluster.torchrun's rendezvous line, fed by torchelastic's own metrics API.

The launcher tests (tests/launcher/) see the line come out of a real torchrun; here the
handler's filtering and round count are checked through ``metrics.prof``, the decorator
torchelastic times its agent's ``_rendezvous`` with.
"""

from __future__ import annotations

import re

import pytest
from torch.distributed.elastic import metrics

from purrsight.cluster.torchrun import RendezvousLog


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
