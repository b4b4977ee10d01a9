"""A cut network between two nodes: two network namespaces joined by a bridge.

The test makes two hosts on this machine (10.231.7.1 and 10.231.7.2, tests/network_hosts.py),
runs one launcher in each, and takes the master's link down mid-run. Both sides must stop
within the watchdog timeout plus a margin, naming the node they lost; with a restart
allowed and the link back up, the job resumes and completes.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import REPO, launcher_env, tiny_overrides
from tests.launcher.conftest import wait_for
from tests.network_hosts import Host, network_hosts

WATCHDOG_S = 15


@pytest.fixture
def two_hosts() -> Iterator[list[Host]]:
    with network_hosts(2) as hosts:
        yield hosts


@pytest.mark.root  # network namespaces
def test_cut_link_is_noticed_named_and_survived(two_hosts: list[Host], synthetic_dir: Path, tmp_path: Path) -> None:
    master, worker = two_hosts
    env = launcher_env(tmp_path / "logs", OMP_NUM_THREADS="1", MAX_RESTARTS="1", RDZV_TIMEOUT="120")
    overrides = tiny_overrides(
        synthetic_dir,
        tmp_path / "runs",
        trainer__max_steps=50,  # cut at step 25: 25 steps to spare, and a resume from step 20 to finish
        checkpoint__every_n_steps=20,
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
        assert [p.wait(timeout=300) for p in procs] == [0, 0]
        text = logs[0].read_text()
        assert re.search(r"torchrun restart 1: resuming from .*step-\d+\.ckpt", text)
        assert (tmp_path / "runs" / "phase2-tiny" / "checkpoints" / "step-00000050.ckpt").exists()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
