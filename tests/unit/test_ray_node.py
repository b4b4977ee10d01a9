"""purrsight.launcher.ray_node, ray_node_size, ray_wait: a job's Ray ports, temp dir, address, size, teardown, wait.

The SLURM tests (tests/cluster/test_ray_batch.py) run it inside real jobs; these check its
decisions one by one, and the teardown and the wait on real processes.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from purrsight.errors import ExitCode
from purrsight.launcher import ray_node, ray_node_size, ray_wait
from purrsight.launcher.ray_node import JobPorts, ray_processes, teardown, temp_dir
from purrsight.launcher.ray_node_size import object_store_bytes
from tests.helpers import REPO


def ports_of(job: str, slots: int) -> set[int]:
    ports = JobPorts.of(job)
    flags = ports.head_flags() + [flag for slot in range(slots) for flag in ports.node_flags(slot)]
    return {int(value) for value in flags[1::2] if value != "0"}


def test_every_port_follows_from_the_job_and_two_jobs_or_two_nodes_never_share_one() -> None:
    head = JobPorts.of("4242").head_flags()
    assert head == ["--port", "14200", "--dashboard-port", "14201", "--ray-client-server-port", "14202"]
    one_node = JobPorts.of("4242").node_flags(0)
    assert one_node[:4] == ["--min-worker-port", "0", "--max-worker-port", "0"]  # the kernel's pick: free by construction
    sixteen = ports_of("4242", 16)
    assert len(sixteen) == 3 + 16 * 6 and min(sixteen) >= 10000 and max(sixteen) < 20000  # below MASTER_PORT's 20000
    assert sixteen.isdisjoint(ports_of("4243", 16))
    assert JobPorts.of("4242") == JobPorts.of("4242.pbs-server")  # a PBS job id's number
    assert JobPorts.of("42") == JobPorts.of("42.server7")  # not the server name's digits
    assert JobPorts.of("7", base=30000).gcs == 30700  # RAY_PORT_BASE


def test_the_temp_dir_is_short_and_the_jobs_own() -> None:
    assert temp_dir("123456", 3) == Path("/tmp/prs-123456-3")
    assert len(str(temp_dir("123456789", 127))) <= ray_node.MAX_TEMP_DIR


def test_a_temp_dir_too_long_for_rays_sockets_is_refused_before_ray_starts(capsys: pytest.CaptureFixture[str]) -> None:
    code = ray_node.main(["start", "head", "--job", "1", "--slot", "0", "--name", "n0", "--temp-root", "/scratch/" + "x" * 40])
    assert code == ExitCode.USAGE
    assert "is too long for its socket paths: set RAY_TMP_ROOT" in capsys.readouterr().err


def test_the_object_store_takes_rays_share_of_the_jobs_memory_held_to_dev_shm() -> None:
    gib = 2**30
    assert object_store_bytes(memory=10 * gib, shm_free=64 * gib) == 3 * gib
    assert object_store_bytes(memory=100 * gib, shm_free=10 * gib) == 9 * gib  # a small /dev/shm
    assert object_store_bytes(memory=100 * 2**20, shm_free=64 * gib) == ray_node_size.MIN_OBJECT_STORE


def test_slurms_memory_limit_sizes_the_node_when_it_is_the_least(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_MEM_PER_NODE", "1000")
    assert ray_node_size.memory_limit() == (1000 * 2**20, "SLURM_MEM_PER_NODE")


def test_the_address_is_node_addr_then_the_schedulers_own_when_this_machine_holds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_ADDR", "10.9.8.7")
    assert ray_node.node_address("127.0.1.5", None) == "10.9.8.7"
    monkeypatch.delenv("NODE_ADDR")
    assert ray_node.node_address("127.0.1.5", None) == "127.0.1.5"  # loopback: held here
    # Another node's address (not held here): the source of the route to the head instead.
    assert ray_node.node_address("192.0.2.1", "127.0.0.1") == "127.0.0.1"


def sleeper(argument: str) -> subprocess.Popen[bytes]:
    """A process that names ``argument`` on its command line, as Ray's processes name their temp dir."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--temp-dir", argument])


def test_teardown_stops_the_jobs_ray_processes_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mine, other_job = tmp_path / "prs-1-1", tmp_path / "prs-1-10"  # a prefix of the other's name
    mine.mkdir()
    ours = [sleeper(str(mine)), sleeper(f"{mine}/session_x/logs")]
    theirs = sleeper(str(other_job))
    try:
        time.sleep(0.5)
        assert sorted(ray_processes(mine)) == sorted(p.pid for p in ours)
        teardown(mine, ray_node.Say("test"), grace_s=5)
        assert all(p.wait(timeout=10) is not None for p in ours)
        assert theirs.poll() is None and not mine.exists()
    finally:
        for process in (*ours, theirs):
            process.kill()
            process.wait()


def test_the_wait_ends_at_once_naming_a_node_whose_step_ended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad_nodes = tmp_path / "bad-nodes"
    monkeypatch.setenv("PURRSIGHT_BAD_NODES_FILE", str(bad_nodes))
    ended = subprocess.Popen(["true"])
    ended.wait()
    start = time.monotonic()
    args = ["wait", "--job", "5", "--head", "127.0.0.1", "--nodes", "n0,n1", "--deadline", "60", "--watch", f"n1={ended.pid}"]
    assert ray_node.main(args) == ExitCode.CLUSTER
    assert time.monotonic() - start < 10
    assert bad_nodes.read_text() == "n1\tray start\n"


def test_the_wait_names_the_missing_nodes_at_its_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_wait, "alive_nodes", lambda dashboard: {"n0": {"CPU": 2.0, "GPU": 8.0}, "n1": {"CPU": 2.0}})
    bad_nodes = tmp_path / "bad-nodes"
    monkeypatch.setenv("PURRSIGHT_BAD_NODES_FILE", str(bad_nodes))
    args = ["wait", "--job", "5", "--head", "127.0.0.1", "--nodes", "n0,n1,n2", "--gpus-per-node", "8", "--deadline", "1"]
    assert ray_node.main(args) == ExitCode.CLUSTER
    assert bad_nodes.read_text() == "n1\tray start\nn2\tray start\n"  # n1 joined without its GPUs


def test_a_bad_config_is_named_before_any_ray_starts(capsys: pytest.CaptureFixture[str]) -> None:
    config = str(REPO / "config" / "train_config.yaml")
    assert ray_node.main(["check-config", config, "trainer.max_steps=-3"]) == ExitCode.USAGE
    assert "config error: override trainer.max_steps=-3" in capsys.readouterr().err
    assert ray_node.main(["check-config", config]) == 0
