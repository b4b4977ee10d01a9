"""A frozen rank named by the others: SIGSTOP of one worker, real launchers, torchrun and gloo.

Every rank publishes its progress to the job's store; the ranks left waiting name the one
they wait for (purrsight/distributed/hang_culprit.py). Nothing is faked: the stopped process is
a real worker of a 2-node x 2-rank job on loopback.
"""

from __future__ import annotations

import pickle
import re
import signal
import socket
import time

import psutil

from purrsight.distributed.hang_culprit import PUBLISH_S
from tests.launcher.conftest import Cluster, wait_for
from tests.launcher.test_launcher import workers

WATCHDOG_S = 20  # well above the publishing interval (2 s), so the frozen rank's heartbeat is seen to stop


def waiting_ranks(verdict: str) -> set[int]:
    """The ranks a verdict lists as waiting: "rank 1 waits after step 13; ranks 0,2 wait in step 14 (backward)"."""
    found: set[int] = set()
    for spans in re.findall(r"ranks? ([\d,-]+) waits? ", verdict):
        for span in spans.split(","):
            first, _, last = span.partition("-")
            found.update(range(int(first), int(last or first) + 1))
    return found


def rank_of(pid: int, node_log: str) -> int:
    """A worker's global rank, from its "process group ready: global rank R of N (...; pid P)" line
    (a worker forked from the launcher's server has that server's /proc/PID/environ, not its rank)."""
    (rank,) = re.findall(rf"process group ready: global rank (\d+) of \d+ \(.*; pid {pid}\)", node_log)
    return int(rank)


def test_sigstop_of_one_rank_of_four_names_that_rank_and_its_node(cluster: Cluster) -> None:
    """SIGSTOP of global rank 3 (node 1, local rank 1): every waiting rank's watchdog names it, and only it;
    both nodes' jobs end with the watchdog's code within its timeout (a node whose ranks' collectives fail
    after a peer's watchdog fired says the hang too), with stacks in the log and no process left."""
    env = {"NPROC_PER_NODE": "2", "MAX_RESTARTS": "0"}
    job = {"trainer__max_steps": 100000, "distributed__progress_timeout_s": WATCHDOG_S, "logging__every_n_steps": 1}
    node0 = cluster.start(2, 0, env=env, **job)
    node1 = cluster.start(2, 1, env=env, **job)
    link = cluster.log_dir / "latest_node0.log"
    assert wait_for(lambda: link.exists() and "step 8/" in cluster.node_log(0), timeout=300)
    time.sleep(2 * PUBLISH_S)  # the victim has published a step past 8 by now
    ranks = workers(node0.proc.pid) + workers(node1.proc.pid)
    (victim,) = [process for process in workers(node1.proc.pid) if rank_of(process.pid, cluster.node_log(1)) == 3]
    victim.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        assert node0.wait(timeout=WATCHDOG_S + 120) == 86, node0.text()[-3000:]  # the watchdog's code, not torchrun's 1
        assert node1.wait(timeout=60) == 86, node1.text()[-3000:]
        ended_in = time.monotonic() - stopped_at
    finally:
        if victim.is_running():
            victim.send_signal(signal.SIGCONT)
    assert ended_in < WATCHDOG_S + 60, ended_in  # the watchdog's timeout plus torchrun's shutdown: nothing hangs
    host = socket.gethostname()
    lines = [line for n in (0, 1) for line in cluster.node_log(n).splitlines() if "watchdog: rank" in line]
    # The first waiting rank to fire ends its node's job, so not every rank gets to say it; the frozen one never does.
    assert lines and {line.split("watchdog: rank ")[1].split(" ")[0] for line in lines} <= {"0", "1", "2"}, lines
    for line in lines:
        assert " made no progress for " in line, line
        verdict = line.split("; hang: ", 1)[1]
        named = re.match(rf"rank 3 \(node 1, {re.escape(host)}\) last finished training step (\d+), ", verdict)
        assert named and int(named.group(1)) >= 8, line  # its published progress, not the start record
        assert "stopped answering" in verdict, line
        # Every other rank waits, though not always in one place: a ring all-reduce relayed through the
        # frozen rank (the stop vote between steps, distributed/stop_vote.py) can release some ranks and hold another.
        assert waiting_ranks(verdict) == {0, 1, 2}, line
    for n in (0, 1):  # a node whose ranks fell to a peer's firing (a collective's error) says the hang too
        assert "watchdog: rank" in cluster.node_log(n) or "error: the job hung: rank" in cluster.node_log(n), n
    assert any("most recent call first" in cluster.node_log(n) for n in (0, 1))  # faulthandler's stacks reached a node log
    hangs = (cluster.run_dir / "hangs.log").read_text()
    assert "rank 3 (node 1" in hangs, hangs
    # The flight recorder of each waiting rank that fired: its last collective never completed.
    dumps = sorted((cluster.run_dir / "flight_recorder").glob("rank_*.pkl"))
    assert dumps, "no flight recorder dump"
    for dump in dumps:
        entries = pickle.loads(dump.read_bytes())["entries"]
        assert entries and entries[-1]["state"] != "completed", (dump, entries[-1])
    time.sleep(1)
    alive = [p.pid for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], alive  # the stopped rank too: torchrun's SIGKILL ends a stopped process
