"""Three nodes with addresses of their own: network namespaces on a bridge (tests/network_hosts.py).

Not a stand-in: each launcher runs in its own network namespace and reaches the others only
through the bridge, so the rendezvous store, gloo and the health checks cross a real
(virtual) network as they would between machines. Node ranks are given the addresses in
reverse order (node 0 on the highest address, where the master is), so torchrun's own
order of the nodes (it sorts them by address) is not the node order the trainer must
restore. (Three nodes, not four: the fourth was one more launcher and trainer, and no case.)
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO, launcher_env, tiny_overrides
from tests.network_hosts import network_hosts

NODES = 3


@pytest.mark.root  # network namespaces
def test_three_hosts_train_one_job_with_node_ordered_ranks(synthetic_dir: Path, tmp_path: Path) -> None:
    env = launcher_env(tmp_path / "logs", OMP_NUM_THREADS="1", RDZV_TIMEOUT="300", MAX_RESTARTS="0")
    overrides = tiny_overrides(synthetic_dir, tmp_path / "runs", trainer__max_steps=10, checkpoint__every_n_steps=10)
    with network_hosts(NODES, subnet="10.231.9") as hosts:
        placed = list(reversed(hosts))  # node rank -> host
        master = placed[0].address
        launcher = ["./cluster_train.sh", "config/train_config.yaml", str(NODES)]
        procs = []
        for rank in reversed(range(NODES)):  # workers first: they wait for the master
            command = placed[rank].command(*launcher, str(rank), master, "29400", "--", *overrides)
            with (tmp_path / f"node{rank}.out").open("w") as out:
                procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT))
        codes = [proc.wait(timeout=600) for proc in procs]
    outputs = {rank: (tmp_path / f"node{rank}.out").read_text() for rank in range(NODES)}
    assert codes == [0] * NODES, [text[-2000:] for text in outputs.values()]
    torchrun_ranks = []
    for rank, host in enumerate(placed):
        log = (tmp_path / "logs" / f"latest_node{rank}.log").read_text()
        assert f"node {rank}/{NODES}: master" in log
        assert f"GLOO_SOCKET_IFNAME={host.link}" in log, "the launcher must pick the interface that routes to the master"
        assert re.search(r"\[torchrun\] rendezvous 0 done in [\d.]+ s", log)
        ordered = re.search(rf"\[node{rank} rank{rank}\] .*local_rank 0: global rank {rank} \(torchrun assigned (\d)\)", log)
        assert ordered, log[-3000:]
        torchrun_ranks.append(int(ordered.group(1)))
        assert f"global rank {rank} of {NODES}" in log
        assert "training finished" in log
    assert sorted(torchrun_ranks) == list(range(NODES))
    checkpoints = tmp_path / "runs" / "phase2-tiny" / "checkpoints"
    assert (checkpoints / "step-00000010.ckpt").exists()
    telemetry = sorted(path.name for path in (tmp_path / "runs" / "phase2-tiny" / "telemetry").iterdir())
    assert telemetry == [f"node{rank}.csv" for rank in range(NODES)]
