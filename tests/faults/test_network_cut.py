"""A cut network between two nodes: two network namespaces joined by a veth pair.

The test makes two hosts on this machine (10.231.7.1 in one namespace, 10.231.7.2 in the
other, a veth pair between them), runs one launcher in each, and takes the link down
mid-run. Both sides must stop within the watchdog timeout plus a margin, naming the node
they lost; with a restart allowed and the link back up, the job resumes and completes.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import REPO, launcher_env, tiny_overrides
from tests.launcher.conftest import wait_for

MASTER, WORKER = "10.231.7.1", "10.231.7.2"
WATCHDOG_S = 15


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    assert done.returncode == 0, f"ip {' '.join(args)}: {done.stderr} (the test needs root and iproute2)"


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str, str]]:
    tag = str(os.getpid())[-5:]
    ns0, ns1, veth0, veth1 = f"pn0{tag}", f"pn1{tag}", f"pv0{tag}", f"pv1{tag}"
    ip("netns", "add", ns0)
    ip("netns", "add", ns1)
    try:
        ip("link", "add", veth0, "type", "veth", "peer", "name", veth1)
        ip("link", "set", veth0, "netns", ns0)
        ip("link", "set", veth1, "netns", ns1)
        for ns, dev, addr in ((ns0, veth0, MASTER), (ns1, veth1, WORKER)):
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield ns0, ns1, veth0
    finally:
        subprocess.run(["ip", "netns", "pids", ns0], capture_output=True)
        for ns in (ns0, ns1):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


def test_cut_link_is_noticed_named_and_survived(two_hosts: tuple[str, str, str], synthetic_dir: Path, tmp_path: Path) -> None:
    ns0, ns1, veth0 = two_hosts
    env = launcher_env(tmp_path / "logs", OMP_NUM_THREADS="1", MAX_RESTARTS="1", RDZV_TIMEOUT="120")
    overrides = tiny_overrides(
        synthetic_dir,
        tmp_path / "runs",
        trainer__max_steps=300,
        checkpoint__every_n_steps=20,
        logging__every_n_steps=1,
        distributed__progress_timeout_s=WATCHDOG_S,
        distributed__timeout_s=60,
    )
    procs = [
        subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "./cluster_train.sh",
                "config/train_config.yaml",
                "2",
                str(rank),
                MASTER,
                "29911",
                "--",
                *overrides,
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for rank, ns in ((0, ns0), (1, ns1))
    ]
    logs = [tmp_path / "logs" / f"latest_node{n}.log" for n in (0, 1)]
    try:
        assert wait_for(lambda: logs[0].exists() and "step 30/" in logs[0].read_text(), timeout=240)
        ip("-n", ns0, "link", "set", veth0, "down")
        cut = time.monotonic()
        noticed = wait_for(lambda: all("watchdog: rank" in log.read_text() for log in logs), timeout=WATCHDOG_S + 45)
        elapsed = time.monotonic() - cut
        ip("-n", ns0, "link", "set", veth0, "up")
        assert noticed, [log.read_text()[-1500:] for log in logs]
        assert elapsed < WATCHDOG_S + 45
        assert f"unreachable: node 1 ({WORKER})" in logs[0].read_text()
        assert f"unreachable: node 0 ({MASTER})" in logs[1].read_text()
        assert [p.wait(timeout=300) for p in procs] == [0, 0]
        text = logs[0].read_text()
        assert re.search(r"torchrun restart 1: resuming from .*step-\d+\.ckpt", text)
        assert (tmp_path / "runs" / "phase2-tiny" / "checkpoints" / "step-00000300.ckpt").exists()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
