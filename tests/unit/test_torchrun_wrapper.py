"""purrsight.launcher.torchrun: its rendezvous line, fed by torchelastic's own metrics API, its
exit code, and its stop on repeated signals.

The launcher tests (tests/launcher/) see the line come out of a real torchrun; here the
handler's filtering and round count are checked through ``metrics.prof``, the decorator
torchelastic times its agent's ``_rendezvous`` with.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic import metrics

from purrsight.launcher.torchrun import RendezvousLog, job_exit_code
from tests.helpers import free_port


class SimpleElasticAgent:  # the name torchelastic's metric carries: <class>._rendezvous.duration.ms
    def __init__(self) -> None:
        self.store_gone = False

    @metrics.prof
    def _rendezvous(self) -> None:
        if self.store_gone:
            raise ConnectionError("the store is gone")

    @metrics.prof
    def _start_workers(self) -> None:
        pass


def test_one_line_per_rendezvous_round_done_or_failed_and_nothing_else(capsys: pytest.CaptureFixture[str]) -> None:
    metrics.configure(RendezvousLog(), group="torchelastic")
    try:
        agent = SimpleElasticAgent()
        agent._rendezvous()
        agent._start_workers()
        agent._rendezvous()
        agent.store_gone = True
        with pytest.raises(ConnectionError):
            agent._rendezvous()
    finally:
        metrics.configure(metrics.NullMetricHandler(), group="torchelastic")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3, lines
    for round_, (line, outcome) in enumerate(zip(lines, ["done in", "done in", "failed after"], strict=True)):
        assert re.fullmatch(rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d \[torchrun\] rendezvous {round_} {outcome} \d+\.\d\d s", line)


def test_the_job_exit_code_is_the_workers_documented_reason() -> None:
    """torchrun's failure records carry each worker's code; a documented one becomes the job's."""
    assert job_exit_code([2, -15]) == 2  # bad input on one rank, the other stopped by torchrun
    assert job_exit_code([-15, 86]) == 86  # the watchdog
    assert job_exit_code([3]) == 3
    assert job_exit_code([-9, 1]) == 1  # killed, or a bug: torchrun's own 1


SLOW_SAVE_WORKER = """
import pathlib, signal, sys, time
def save_then_exit(signum, frame):
    time.sleep(3)  # a checkpoint being written while more signals arrive
    print("worker: checkpoint saved", flush=True)
    sys.exit(143)
signal.signal(signal.SIGTERM, save_then_exit)
pathlib.Path(sys.argv[1]).touch()
while True:
    time.sleep(0.1)
"""


def test_repeated_sigterms_stop_torchrun_once_after_its_worker_saved(tmp_path: Path) -> None:
    """Three SIGTERMs, as a SLURM step cancel gives torchrun (slurmstepd signals every process
    of the step, and the launcher forwards its own copy): torchelastic alone hangs at exit after
    the third (its log tail threads are never stopped), and returns before its worker is done."""
    worker, ready = tmp_path / "worker.py", tmp_path / "ready"
    worker.write_text(SLOW_SAVE_WORKER)
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "purrsight.launcher.torchrun", "--nnodes", "1", "--nproc-per-node", "1",
         "--log-dir", str(tmp_path / "logs"), "--tee", "3", str(worker), str(ready)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert torchrun.poll() is None and time.monotonic() < deadline, "the worker never started"
            time.sleep(0.2)
        for pause in (1.0, 0.5, 0.0):
            os.kill(torchrun.pid, signal.SIGTERM)
            time.sleep(pause)
        output, _ = torchrun.communicate(timeout=60)
    finally:
        torchrun.kill()
    assert torchrun.returncode == 128 + signal.SIGTERM, output
    assert output.count("torchrun: SIGTERM again while stopping on SIGTERM: ignored") == 2, output
    assert output.index("worker: checkpoint saved") < output.index("torchrun: stopped by SIGTERM"), output


ENDS_WITH_86_AFTER = """
import sys, time
time.sleep(float(sys.argv[1]))  # node 0's worker ends first, so its agent (the store's host) is gone
sys.exit(86)
"""


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_node_outliving_the_store_host_keeps_its_workers_codes_and_fails_a_rendezvous_in_one_line(
    tmp_path: Path, restarts: int
) -> None:
    """Two real agents on loopback; node 0 (holding the c10d store) ends 4 s before node 1's worker.
    Node 1's agent polls the gone store between its checks of that worker: it says so once and still
    ends with the worker's 86 (the hang test's failure in CI was torchrun's 1 and a traceback). With a
    restart left, its next rendezvous cannot reach the store: one line naming that, and still the
    worker's 86 (node 0 may have spent its restarts while node 1 has some: a join costs none)."""
    worker, port = tmp_path / "worker.py", free_port()
    worker.write_text(ENDS_WITH_86_AFTER)

    def agent(node: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "purrsight.launcher.torchrun", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-conf", f"is_host={node == 0},join_timeout=60", "--monitor-interval", "0.1",
             "--max-restarts", str(restarts if node else 0), str(worker), str(1 + 4 * node)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    agents = [agent(0), agent(1)]
    try:
        outputs = [agent.communicate(timeout=90)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert agents[0].returncode == 86, outputs[0]
    assert outputs[1].count(f"torchrun: the rendezvous store at 127.0.0.1:{port} is gone") == 1, outputs[1]
    assert "Traceback" not in outputs[1], outputs[1]
    assert agents[1].returncode == 86, outputs[1]
    assert "torchrun: rank 1 (local rank 0, pid " in outputs[1] and ") exited with code 86" in outputs[1], outputs[1]
    failed = re.findall(rf"torchrun: the rendezvous at 127\.0\.0\.1:{port} failed \((.*)\)", outputs[1])
    if restarts == 0:
        assert not failed, outputs[1]
    else:  # the wrapped error and its cause: torchelastic's own says only "see inner exception"
        assert len(failed) == 1 and failed[0].startswith("RendezvousConnectionError: ") and "; " in failed[0], failed
