"""Two nodes on a real (virtual) network: two network namespaces joined by a bridge.

The test makes two hosts on this machine (10.231.7.1 and 10.231.7.2, tests/network_hosts.py),
runs one launcher in each, and takes the master's link down mid-run. Both sides must stop
within the watchdog timeout plus a margin, naming the node they lost; with a restart
allowed and the link back up, the job resumes. In the resumed job the rank on the second
host is then frozen (SIGSTOP): the master's watchdog names it across the network and ends
the job with its own code, the restart being spent.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from purrsight.distributed.hang_culprit import PUBLISH_S
from tests.helpers import REPO, launcher_env, record_samples_env, tiny_overrides
from tests.launcher.conftest import kill_whole, wait_for, wait_for_workers_at_the_master_check
from tests.launcher.test_elastic import check_global_batch_and_every_sample_once, resumed_and_training, steps_trained
from tests.launcher.test_launcher import workers
from tests.network_hosts import Host, network_hosts

WATCHDOG_S = 15


@pytest.fixture
def two_hosts() -> Iterator[list[Host]]:
    with network_hosts(2) as hosts:
        yield hosts


def resumed_part(log: Path) -> str:
    """The node log from the restart's resume line on ("" before the restart)."""
    _, marker, rest = log.read_text().partition("torchrun restart 1: resuming from")
    return marker + rest


@pytest.mark.root  # network namespaces
def test_cut_link_is_noticed_named_and_survived_then_a_frozen_rank_is_named(
    two_hosts: list[Host], synthetic_dir: Path, tmp_path: Path
) -> None:
    master, worker = two_hosts
    env = launcher_env(tmp_path / "logs", OMP_NUM_THREADS="1", MAX_RESTARTS="1", RDZV_TIMEOUT="120")
    overrides = tiny_overrides(
        synthetic_dir,
        tmp_path / "runs",
        trainer__max_steps=100000,  # never reached: the job ends in the frozen rank's hang
        checkpoint__every_n_steps=20,  # the cut comes at step 25 or later: the restart resumes from a checkpoint
        logging__every_n_steps=1,
        distributed__progress_timeout_s=WATCHDOG_S,
        distributed__timeout_s=60,
    )
    launcher = ["./cluster_train.sh", "config/train_config.yaml", "2"]
    procs = [
        subprocess.Popen(
            host.command(*launcher, str(rank), master.address, "29911", "--", *overrides),
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for rank, host in enumerate(two_hosts)
    ]
    logs = [tmp_path / "logs" / f"latest_node{n}.log" for n in (0, 1)]
    try:
        assert wait_for(lambda: logs[0].exists() and "step 25/" in logs[0].read_text(), timeout=240)
        master.set_link(up=False)
        cut = time.monotonic()
        noticed = wait_for(lambda: all("watchdog: rank" in log.read_text() for log in logs), timeout=WATCHDOG_S + 45)
        elapsed = time.monotonic() - cut
        master.set_link(up=True)
        assert noticed, [log.read_text()[-1500:] for log in logs]
        assert elapsed < WATCHDOG_S + 45
        assert f"unreachable: node 1 ({worker.address})" in logs[0].read_text()
        assert f"unreachable: node 0 ({master.address})" in logs[1].read_text()
        # the last checkpoint before the cut: step 20, or a later one where training ran on past
        # step 25 before the link went down (28 steps/s on an idle machine)
        resuming = r"torchrun restart 1: resuming from .*step-(\d+)\.ckpt"
        assert wait_for(lambda: re.match(resuming, resumed_part(logs[0])), timeout=240), logs[0].read_text()[-3000:]
        resumed_from = int(re.match(resuming, resumed_part(logs[0])).group(1))  # type: ignore[union-attr]
        assert resumed_from >= 20 and resumed_from % 20 == 0, resumed_from
        assert wait_for(lambda: f"step {resumed_from + 4}/" in resumed_part(logs[0]), timeout=240), logs[0].read_text()[-3000:]

        time.sleep(2 * PUBLISH_S)  # the victim has published a step of the resumed job by now
        (victim,) = workers(procs[1].pid)
        victim.send_signal(signal.SIGSTOP)
        assert procs[0].wait(timeout=WATCHDOG_S + 120) == 86  # the watchdog's code: no restart left
    finally:
        # Every process of both nodes: node 1's launcher, torchrun agent and fork server outlived node
        # 0's end by half an hour once (the frozen worker never exits, and the agent waits for it).
        # The forked workers have sessions of their own, so a killpg of the launcher's misses them.
        for proc in procs:
            kill_whole(proc.pid)
            proc.wait()
    verdict = resumed_part(logs[0])
    assert re.search(
        rf"hang: rank 1 \(node 1, {re.escape(socket.gethostname())}\) last finished training step \d+, .*stopped answering", verdict
    ), verdict[-3000:]
    assert "rank 0 waits" in verdict


@pytest.mark.root  # network namespaces
def test_an_elastic_job_goes_on_without_the_node_cut_off_the_network_with_the_global_batch_kept(
    synthetic_dir: Path, tmp_path: Path
) -> None:
    """Issue 51, item 6: three hosts on a bridge, an elastic 2:3 job (one rank each, a global batch
    of 12 = 3 x 2 x 2), host 2's cable pulled past step 8. No connection is reset, so the two
    others' collectives would wait for their watchdog (15 s); but their agents see host 2 leave the
    round once its keep-alives stop (3 s; one agent at least: the other's worker may end first, on
    the connection the first one's kill closed), kill their workers, meet again without it, and resume
    from the last checkpoint at 2 x 2 x 3, the global batch kept, and finish: every step trains 12
    samples (an epoch's last window aside), no epoch a sample twice; no watchdog fired on them.
    Host 2 ends too, with the watchdog's 86: its watchdog names
    both others unreachable, its agent finds the store gone (a request unanswered for
    RDZV_STORE_TIMEOUT, 10 s here) and its restart's rendezvous fails, each in one line, without
    the store clients' C++ retries at every heartbeat."""
    records, steps = tmp_path / "samples", 30
    env = launcher_env(
        tmp_path / "logs", OMP_NUM_THREADS="1", MAX_RESTARTS="2", RDZV_TIMEOUT="120", NPROC_PER_NODE="1", BACKEND="gloo",
        RDZV_LAST_CALL_S="4", RDZV_STORE_TIMEOUT="10",
    )  # fmt: skip
    env |= record_samples_env(records, env)
    overrides = tiny_overrides(
        synthetic_dir, tmp_path / "runs", data__batch_size=2, trainer__global_batch_size=12, trainer__max_steps=steps,
        checkpoint__every_n_steps=5, trainer__val_every_n_steps=1000, logging__every_n_steps=1,
        distributed__progress_timeout_s=WATCHDOG_S, distributed__timeout_s=60,
    )  # fmt: skip
    with network_hosts(3, subnet="10.231.8") as hosts:
        master = hosts[0]

        def start(rank: int) -> subprocess.Popen[bytes]:
            launcher = ["./cluster_train.sh", "config/train_config.yaml", "2:3", str(rank), master.address, "29913"]
            out = (tmp_path / f"node{rank}.out").open("w")
            return subprocess.Popen(hosts[rank].command(*launcher, "--", *overrides), cwd=REPO, env=env, stdout=out, stderr=out)

        procs = {rank: start(rank) for rank in (1, 2)}
        wait_for_workers_at_the_master_check([(procs[rank], tmp_path / f"node{rank}.out") for rank in (1, 2)])
        procs[0] = start(0)
        log = tmp_path / "logs" / "latest_node0.log"
        try:
            assert wait_for(lambda: log.exists() and "step 8/" in log.read_text(), timeout=240), (
                tmp_path / "node0.out"
            ).read_text()[-3000:]
            before = len(log.read_text())
            hosts[2].set_link(up=False)
            cut_ns, cut = time.time_ns(), time.monotonic()
            again = wait_for(lambda: resumed_and_training(log, before, steps), timeout=180)
            again_s = time.monotonic() - cut
            assert again, log.read_text()[-4000:]
            codes = {rank: procs[rank].wait(timeout=240) for rank in (0, 1, 2)}
        finally:
            for proc in procs.values():
                kill_whole(proc.pid)
                proc.wait()
    after = log.read_text()[before:]
    cut_off = (tmp_path / "logs" / "latest_node2.log").read_text()
    assert codes == {0: 0, 1: 0, 2: 86}, (codes, cut_off[-4000:])
    ended = re.search(r"(\S+ \S+) \[cluster_train\] training ended with exit code 86", cut_off)
    assert ended, cut_off[-4000:]
    cut_off_ended_s = time.mktime(time.strptime(ended.group(1), "%Y-%m-%d %H:%M:%S")) - cut_ns / 1e9  # to 1 s
    print(f"host 2 cut off: the two others trained again {again_s:.1f} s after the cut; host 2 ended after {cut_off_ended_s:.0f} s")
    assert "unreachable: node 0 (10.231.8.1), node 1 (10.231.8.2)" in cut_off, cut_off[-4000:]
    assert cut_off.count("torchrun: the rendezvous store at 10.231.8.1:29913 is gone") == 1, cut_off[-4000:]
    # Its restart's rendezvous, round 1, or 2 where a node joined the first one late (its last call,
    # 4 s, ran out on a crowded host before the third node's agent came: a round more, seen once in a
    # full suite on 2026-11-30). The rounds below are counted the same way.
    assert re.search(r"\[torchrun\] rendezvous [12] failed after [\d.]+ s\n", cut_off), cut_off[-4000:]
    assert "torchrun: rank 2 (local rank 0, pid " in cut_off and ") exited with code 86" in cut_off, cut_off[-4000:]
    # the store clients' noise: a TCPStore client's retries (a C++ stack each); the agent's
    # requests to a store already gone, every second (three remain: a keep-alive, the restart's
    # rendezvous and its close)
    assert "TCP client failed to connect/validate" not in cut_off, cut_off[-4000:]
    assert cut_off.count("sendBytes failed") <= 3, cut_off[-4000:]
    assert cut_off_ended_s < WATCHDOG_S + 45, cut_off_ended_s
    assert "global batch 12 = 2 processes x 2 (data.batch_size) x 3 micro-batches per step" in after, after[-4000:]
    assert "elastic round of 2 node(s) [0, 1]" in after, after[-4000:]
    # Each survivor's agent names the node cut off, or, where the other survivor's agent noticed
    # first and killed its workers, this one's worker ends on the connection that kill closed (to
    # the other survivor's address, never the cut-off host's, whose connections nothing resets) and
    # its agent restarts it: a race seen once in a full suite (2026-11-29), node 1's worker saw node
    # 0's go before its own agent's second without keep-alives had passed. At least one agent names
    # the node; no worker waited for its watchdog. Which way each survivor went is printed.
    lost = re.compile(r"torchrun: node\(s\) 10\.231\.8\.3 stopped sending keep-alives and left rendezvous round [01]: lost")
    named = []
    for node in (0, 1):
        survivor = (tmp_path / "logs" / f"latest_node{node}.log").read_text()
        survivor = survivor[survivor.index("rendezvous 0 done") :]
        other = re.escape(f"10.231.8.{2 - node}")  # the other survivor's address (node n has 10.231.8.n+1)
        closed_by_other = re.search(rf"error: a peer process is gone \(Connection (closed|reset) by peer \[{other}\]", survivor)
        times_named = len(lost.findall(survivor))
        assert times_named == 1 or closed_by_other, survivor[-4000:]
        assert times_named <= 1, survivor[-4000:]
        assert "watchdog: rank" not in survivor, survivor[-4000:]
        named += [node] if times_named else []
        how = "its agent named the node cut off" if times_named else f"its worker ended on node {1 - node}'s kill"
        print(f"node {node}: {how}")
    assert named, "no agent named the node cut off"
    resumed = re.search(r"resuming from checkpoint .*step-(\d+)\.ckpt", after)
    assert resumed, after[-4000:]
    # A bound on a hang, which would wait out the agents' 120 s rendezvous join timeout; the figure is
    # printed. 62 s once, on a machine running at half its speed (2026-11-29).
    assert again_s < WATCHDOG_S + 75, again_s
    trained = steps_trained(records, [(0, 3, 0, int(resumed.group(1))), (cut_ns, 2, int(resumed.group(1)), steps)])
    check_global_batch_and_every_sample_once(trained, steps, synthetic_dir)
