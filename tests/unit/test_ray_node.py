"""purrsight.ray_node: a job's Ray ports, temp dir, address, size, process tree and wait, one by one.

The SLURM and PBS tests (tests/cluster) run it inside real jobs and tests/ray/test_ray_node.py
with real Ray; these check its decisions on real sockets, folders and processes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from purrsight.errors import ExitCode
from purrsight.launcher.cpus import usable_cpus
from purrsight.ray_node import __main__ as cli
from purrsight.ray_node import node, processes, resources, temp, wait
from purrsight.ray_node.ports import JobPorts, free_block, node_flags, port_free
from purrsight.ray_node.say import Say
from tests.helpers import REPO


def ports_of(job: str, slots: int) -> set[int]:
    ports = JobPorts.of(job)
    return {*ports.head().values(), *(port for slot in range(slots) for port in ports.node(slot).values())}


def test_every_port_follows_from_the_job_and_two_jobs_or_two_nodes_never_share_one() -> None:
    assert JobPorts.of("4242").head() == {"--port": 14200, "--dashboard-port": 14201, "--ray-client-server-port": 14202}
    sixteen = ports_of("4242", 16)
    assert len(sixteen) == 3 + 16 * 6 and min(sixteen) >= 10000 and max(sixteen) < 20000  # below MASTER_PORT's 20000
    assert sixteen.isdisjoint(ports_of("4243", 16))
    assert JobPorts.of("4242") == JobPorts.of("4242.pbs-server")  # a PBS job id's number
    assert JobPorts.of("42") == JobPorts.of("42.server7")  # not the server name's digits
    assert JobPorts.of("7", range_base=30000).gcs == 30700  # RAY_PORT_BASE


@pytest.fixture
def listening() -> Iterator[list[socket.socket]]:
    """Sockets that hold ports as another job or a site's service would (listening on one address)."""
    held: list[socket.socket] = []
    yield held
    for sock in held:
        sock.close()


def hold(held: list[socket.socket], port: int, address: str = "127.0.0.1") -> None:
    sock = socket.socket()
    sock.bind((address, port))
    sock.listen()
    held.append(sock)


def test_a_port_in_use_moves_the_job_to_the_next_free_block_and_a_node_to_the_next_free_port(
    listening: list[socket.socket],
) -> None:
    """Two jobs whose ids differ by 100 share a block; a site's service can sit in the range."""
    job = str(21000 + 37)  # far from the blocks other tests' Ray jobs take
    mine = JobPorts.of(job)
    free = free_block(job)
    assert free is not None
    if free != mine:
        pytest.skip(f"block {mine.base} is busy on this machine already")
    hold(listening, mine.dashboard, "127.0.1.7")  # another job's dashboard, on one address only
    moved = free_block(job)
    assert moved is not None and moved.base != mine.base and all(port_free(p) for p in moved.head().values())
    assert moved.base == mine.base + 100 or not all(port_free(p) for p in JobPorts(mine.base + 100).head().values())

    wanted = moved.node(1)["--object-manager-port"]
    hold(listening, wanted)
    said: list[tuple[str, int, int]] = []
    flags = node_flags(moved, 1, moved=lambda flag, port, instead: said.append((flag, port, instead)))
    chosen = dict(zip(flags[::2], (int(value) for value in flags[1::2]), strict=True))
    assert chosen["--object-manager-port"] != wanted and port_free(chosen["--object-manager-port"])
    assert said == [("--object-manager-port", wanted, chosen["--object-manager-port"])]
    assert len(set(chosen.values()) - {0}) == 6 and not set(chosen.values()) & set(moved.head().values())


def test_the_ports_command_prints_a_free_block_for_the_head_and_one_line_when_there_is_none(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["ports", "--job", "21042"]) == 0
    assert int(capsys.readouterr().out) % 100 == 0
    assert free_block("5", is_free=lambda port: False) is None
    assert cli.main(["ports", "--job", "5", "--range-base", "70000"]) == ExitCode.FAILED  # not a port number: none binds
    assert "no block of 100 free ports in 70000-79999" in capsys.readouterr().err


def test_the_temp_dir_is_short_and_the_jobs_own(tmp_path: Path) -> None:
    assert temp.wanted("123456", 3) == Path("/tmp/prs-123456-3")
    made = temp.make_temp_dir("77", 0, str(tmp_path), Say("test"))
    assert made == tmp_path / "prs-77-0" and made.stat().st_mode & 0o777 == 0o700
    (made / "session_old").mkdir()  # a run of this job before a requeue
    assert temp.make_temp_dir("77", 0, str(tmp_path), Say("test")) == made and not any(made.iterdir())


def test_someone_elses_folder_at_the_jobs_temp_dir_is_left_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Another user's /tmp/prs-<job>-<slot> (a job of theirs, or a trap: a link) is not ours to remove or use."""
    theirs = tmp_path / "prs-78-0"
    theirs.mkdir()
    (theirs / "their-file").write_text("theirs")
    (tmp_path / "prs-78-1").symlink_to(theirs)
    slots = [1]
    if os.geteuid() == 0:  # only root can make a folder of another user's
        os.chown(theirs, 65534, 65534)
        slots.append(0)
    for slot in slots:
        found = tmp_path / f"prs-78-{slot}"
        made = temp.make_temp_dir("78", slot, str(tmp_path), Say("test"))
        assert made.parent == tmp_path and made.name.startswith(f"prs-78-{slot}-"), made
        assert made.stat().st_mode & 0o777 == 0o700 and not any(made.iterdir())
        assert f"{found} is a " in capsys.readouterr().err
    assert (theirs / "their-file").read_text() == "theirs" and (tmp_path / "prs-78-1").is_symlink()


def test_a_temp_dir_too_long_for_rays_sockets_is_refused_before_ray_starts(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["start", "head", "--job", "1", "--ports", "10100", "--slot", "0", "--name", "n0", "--temp-root", "/scratch/" + "x" * 30]
    assert cli.main(args) == ExitCode.USAGE
    assert "is too long for its socket paths: set RAY_TMP_ROOT" in capsys.readouterr().err


def test_the_object_store_takes_rays_share_of_the_jobs_memory_held_to_dev_shm() -> None:
    gib = 2**30
    assert resources.object_store_bytes(memory=10 * gib, shm_free=64 * gib) == 3 * gib
    assert resources.object_store_bytes(memory=100 * gib, shm_free=10 * gib) == 9 * gib  # a small /dev/shm
    assert resources.object_store_bytes(memory=100 * 2**20, shm_free=64 * gib) == resources.MIN_OBJECT_STORE


def test_slurms_memory_in_each_of_its_three_forms_sizes_the_node() -> None:
    """--mem, --mem-per-cpu (times the job's CPUs on the node), --mem-per-gpu (times its GPUs)."""
    mib = 2**20
    assert resources.memory_limit({"SLURM_MEM_PER_NODE": "1000"}) == (1000 * mib, "SLURM_MEM_PER_NODE")
    per_cpu = {"SLURM_MEM_PER_CPU": "100", "SLURM_CPUS_ON_NODE": "3"}
    assert resources.memory_limit(per_cpu, cpus=2) == (300 * mib, "SLURM_MEM_PER_CPU x 3 CPUs")
    assert resources.memory_limit({"SLURM_MEM_PER_CPU": "100"}, cpus=2) == (200 * mib, "SLURM_MEM_PER_CPU x 2 CPUs")
    assert resources.memory_limit({"SLURM_MEM_PER_GPU": "200"}, gpus=2) == (400 * mib, "SLURM_MEM_PER_GPU x 2 GPUs")
    assert resources.memory_limit({"SLURM_MEM_PER_GPU": "200"}, gpus=0)[1] != "SLURM_MEM_PER_GPU x 0 GPUs"


def proc_tree(tmp: Path, cgroup: str, mounts: list[str]) -> Path:
    """A /proc/self with the cgroup and mountinfo files the kernel writes (their layout, our paths)."""
    proc = tmp / "proc-self"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text("".join(f"{n} 1 0:{n} {line}\n" for n, line in enumerate(mounts, start=30)))
    return proc


def test_the_cgroup_limits_are_read_on_v1_and_v2_up_to_the_mount(tmp_path: Path) -> None:
    """The files as each cgroup version lays them out (this machine has only one version): the job's
    folder above the step's holds the limit, the container's mount hides the host's part of the path."""
    v1 = tmp_path / "v1"
    step = v1 / "memory" / "slurm" / "job_9" / "step_0"
    cpu_step = v1 / "cpu,cpuacct" / "slurm" / "job_9" / "step_0"
    for folder in (step, cpu_step):
        folder.mkdir(parents=True)
    (step / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (step.parent / "memory.limit_in_bytes").write_text(f"{3 * 2**30}\n")
    (cpu_step / "cpu.cfs_quota_us").write_text("250000\n")
    (cpu_step / "cpu.cfs_period_us").write_text("100000\n")
    proc = proc_tree(
        tmp_path,
        "12:memory:/slurm/job_9/step_0\n4:cpu,cpuacct:/slurm/job_9/step_0\n0::/\n",
        [f"/ {v1}/memory rw - cgroup cgroup rw,memory", f"/ {v1}/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct"],
    )
    from purrsight.launcher import cgroups

    assert cgroups.memory_limit(proc) == 3 * 2**30
    assert cgroups.cpu_quota(proc) == 2.5
    assert usable_cpus({}, affinity=set(range(8)), proc=proc) == (2, "cgroup CPU quota")

    v2 = tmp_path / "v2"
    (v2 / "job" / "step").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (v2 / "job" / "memory.max").write_text(f"{2**30}\n")
    (v2 / "job" / "step" / "memory.max").write_text("max\n")
    (v2 / "job" / "step" / "cpu.max").write_text("400000 100000\n")
    other = tmp_path / "other"
    other.mkdir()
    proc2 = proc_tree(other, "0::/containers/c1/job/step\n", [f"/containers/c1 {v2} rw - cgroup2 cgroup2 rw"])
    assert cgroups.memory_limit(proc2) == 2**30 and cgroups.cpu_quota(proc2) == 4.0


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp root short enough for Ray's socket paths (pytest's tmp_path is not)."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="prs-t", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_a_ray_node_and_the_launcher_count_cpus_by_one_rule(short_tmp: Path) -> None:
    """SLURM_CPUS_PER_TASK below the mask (task/none counts CPUs without binding them): both say 1.

    The Ray node's sizing line, from a real `start` whose Ray is `true` (it ends at once)."""
    env = {**os.environ, "SLURM_CPUS_PER_TASK": "1", "PYTHONPATH": str(REPO)}
    args = ["start", "head", "--job", "21071", "--ports", "0", "--slot", "0", "--name", "n0", "--temp-root", str(short_tmp)]
    args += ["--ray", "/bin/true", "--hint", "127.0.0.1"]
    done = subprocess.run([sys.executable, "-m", "purrsight.ray_node", *args], env=env, capture_output=True, text=True, timeout=60)
    assert "head at 127.0.0.1: 1 CPUs (SLURM_CPUS_PER_TASK)" in done.stderr, done.stderr
    assert usable_cpus(env)[0] == 1


def test_the_address_is_node_addr_then_the_schedulers_own_when_this_machine_holds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from purrsight.ray_node.address import node_address

    monkeypatch.setenv("NODE_ADDR", "10.9.8.7")
    assert node_address("127.0.1.5", None) == "10.9.8.7"
    monkeypatch.delenv("NODE_ADDR")
    assert node_address("127.0.1.5", None) == "127.0.1.5"  # loopback: held here
    # Another node's address (not held here): the source of the route to the head instead.
    assert node_address("192.0.2.1", "127.0.0.1") == "127.0.0.1"


ORPHAN_MAKER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a held SIGTERM: only SIGKILL ends them
child = os.fork()
if child == 0:
    grandchild = os.fork()
    if grandchild == 0:
        time.sleep(600)
    print(grandchild, flush=True)
    os._exit(0)  # the grandchild is orphaned: a subreaper gets it, not init
os.waitpid(child, 0)
time.sleep(600)
"""


def test_the_teardown_kills_the_whole_tree_orphans_included() -> None:
    """A subreaper's tree: an orphaned grandchild (a worker's data loader, a daemonised helper) that
    ignores SIGTERM and names nothing of the job on its command line is taken down too."""
    script = (
        "import subprocess, sys\n"
        "from purrsight.ray_node import processes\n"
        "processes.become_subreaper()\n"
        f"maker = subprocess.Popen([sys.executable, '-c', {ORPHAN_MAKER!r}], stdout=subprocess.PIPE, text=True)\n"
        "orphan = int(maker.stdout.readline())\n"
        "print(orphan, flush=True)\n"
        "sys.stdin.readline()\n"
        "print(processes.kill_tree(__import__('os').getpid()), flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    root = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert root.stdin is not None and root.stdout is not None
    try:
        orphan = int(root.stdout.readline())
        time.sleep(0.3)
        assert Path(f"/proc/{orphan}").exists() and processes.descendants(root.pid).get(orphan) == "S"  # adopted
        root.stdin.write("\n")
        root.stdin.flush()
        assert root.stdout.readline().strip() == "[]"
        assert not Path(f"/proc/{orphan}").exists() or processes.descendants(root.pid) == {}
    finally:
        for pid in processes.descendants(root.pid):
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(pid, 9)
        root.kill()
        root.wait()


def test_a_stop_before_ray_starts_is_handled_and_ray_is_never_started(short_tmp: Path) -> None:
    """SIGTERM while a worker waits for its head: a line and exit 0, not death by the signal (which
    would leave Ray, had it started, without a teardown)."""
    args = ["start", "worker", "--job", "21072", "--ports", "10000", "--slot", "1", "--name", "n1", "--head", "192.0.2.1"]
    args += ["--temp-root", str(short_tmp), "--ray", "/bin/false", "--head-wait", "60"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "NODE_ADDR": "127.0.0.1"}
    started = subprocess.Popen([sys.executable, "-m", "purrsight.ray_node", *args], env=env, stderr=subprocess.PIPE, text=True)
    assert started.stderr is not None
    assert "waiting for the head" in started.stderr.readline() + started.stderr.readline()
    started.send_signal(15)
    assert started.wait(timeout=20) == 0
    assert "stopped before Ray started" in started.stderr.read()
    assert not (short_tmp / "prs-21072-1").exists()


def test_a_workers_ray_start_waits_for_a_slow_heads_registration_as_long_as_for_its_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray's `ray start` of a worker asks the head's GCS for the head's node 20 times, 2 s apart: on
    the loaded test cluster a head whose raylet took over a minute to register failed its worker's
    start, and the worker's node was excluded. The worker now waits --head-wait for it too."""
    monkeypatch.delenv("RAY_NUM_REDIS_GET_RETRIES", raising=False)
    args = cli.parse_args(["start", "worker", "--job", "7", "--ports", "10000", "--slot", "1", "--name", "n1", "--head", "h"])
    assert node.ray_start_env(args)["RAY_NUM_REDIS_GET_RETRIES"] == "150"  # 300 s
    args.role = "head"
    assert "RAY_NUM_REDIS_GET_RETRIES" not in node.ray_start_env(args)
    monkeypatch.setenv("RAY_NUM_REDIS_GET_RETRIES", "7")  # a site's own setting wins
    args.role = "worker"
    assert node.ray_start_env(args)["RAY_NUM_REDIS_GET_RETRIES"] == "7"


def test_the_wait_ends_at_once_naming_a_node_whose_step_ended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad_nodes = tmp_path / "bad-nodes"
    monkeypatch.setenv("PURRSIGHT_BAD_NODES_FILE", str(bad_nodes))
    ended = subprocess.Popen(["true"])
    ended.wait()
    start = time.monotonic()
    args = ["wait", "--ports", "10500", "--head", "127.0.0.1", "--nodes", "n0,n1", "--deadline", "60"]
    args += ["--watch", f"n1={ended.pid}", "--log-dir", str(tmp_path)]
    assert cli.main(args) == ExitCode.CLUSTER
    assert time.monotonic() - start < 10
    assert bad_nodes.read_text() == "n1\tray start\n"


def test_a_node_whose_ports_were_taken_is_named_in_one_line_and_not_blamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bad_nodes = tmp_path / "bad-nodes"
    monkeypatch.setenv("PURRSIGHT_BAD_NODES_FILE", str(bad_nodes))
    ended = subprocess.Popen(["true"])
    ended.wait()
    (tmp_path / f"n0{node.ENDED_SUFFIX}").write_text("ports\terror: the head's port 10500 (--port) was taken on n0\n")
    args = ["wait", "--ports", "10500", "--head", "127.0.0.1", "--nodes", "n0,n1", "--deadline", "60"]
    args += ["--watch", f"n0={ended.pid}", "--log-dir", str(tmp_path)]
    assert cli.main(args) == ExitCode.FAILED  # the job requeues; no node excluded
    assert not bad_nodes.exists()
    assert "node n0's Ray could not start: error: the head's port 10500 (--port) was taken" in capsys.readouterr().err


def test_the_wait_names_the_missing_nodes_at_its_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wait, "alive_nodes", lambda dashboard: {"n0": {"CPU": 2.0, "GPU": 8.0}, "n1": {"CPU": 2.0}})
    bad_nodes = tmp_path / "bad-nodes"
    monkeypatch.setenv("PURRSIGHT_BAD_NODES_FILE", str(bad_nodes))
    args = ["wait", "--ports", "10500", "--head", "127.0.0.1", "--nodes", "n0,n1,n2", "--gpus-per-node", "8", "--deadline", "1"]
    assert cli.main(args) == ExitCode.CLUSTER
    assert bad_nodes.read_text() == "n1\tray start\nn2\tray start\n"  # n1 joined without its GPUs


def test_a_bad_config_is_named_before_any_ray_starts(capsys: pytest.CaptureFixture[str]) -> None:
    config = str(REPO / "config" / "train_config.yaml")
    assert cli.main(["check-config", config, "trainer.max_steps=-3"]) == ExitCode.USAGE
    assert "config error: override trainer.max_steps=-3" in capsys.readouterr().err
    assert cli.main(["check-config", config]) == 0


def test_the_stop_budget_adds_up() -> None:
    """USR1's lead before the time limit covers the stop's worst case by default: the driver's stop
    wait, the teardown and the requeue (ray.sbatch's stop_budget refuses a lead that does not;
    tests/shell/batch_scripts.bats runs that check)."""
    import re

    sbatch = (REPO / "slurm" / "ray.sbatch").read_text()
    cluster = (REPO / "batch" / "ray_cluster.sh").read_text()
    (lead,) = re.findall(r"^#SBATCH --signal=B:USR1@(\d+)", sbatch, flags=re.M)
    stop_wait = int(re.findall(r"RAY_STOP_WAIT_DEFAULT=(\d+)", cluster)[0])
    teardown = int(re.findall(r"RAY_TEARDOWN_S=(\d+)", cluster)[0])
    requeue = int(re.findall(r"^readonly REQUEUE_S=(\d+)", sbatch, flags=re.M)[0])
    assert int(lead) >= stop_wait + teardown + requeue, (lead, stop_wait, teardown, requeue)
    assert f"--signal=B:USR1@{lead}" in (REPO / "docs" / "SCHEDULERS.md").read_text()


def test_a_port_taken_between_the_probe_and_rays_bind_is_named_and_blames_no_node(short_tmp: Path) -> None:
    """Another process binds the head's GCS port after the node probed it, before its Ray binds it:
    Ray's start fails, and the node says which port and records "ports" (no node excluded, the job
    requeued), not exit 3 (a node's fault). The stub `ray start` lets the test take the port, then
    fails as Ray does on a taken port."""
    stub = short_tmp / "ray"
    stub.write_text(f"#!/bin/sh\ntouch {short_tmp}/probed\nwhile [ ! -e {short_tmp}/bound ]; do sleep 0.05; done\nexit 1\n")
    stub.chmod(0o755)
    block = JobPorts.of("21073")
    args = ["start", "head", "--job", "21073", "--ports", str(block.base), "--slot", "0", "--name", "n0"]
    args += ["--temp-root", str(short_tmp), "--ray", str(stub), "--hint", "127.0.0.1", "--log-dir", str(short_tmp)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = subprocess.Popen([sys.executable, "-m", "purrsight.ray_node", *args], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (short_tmp / "probed").exists():
        assert time.monotonic() < deadline and started.poll() is None, started.stderr.read() if started.stderr else ""
        time.sleep(0.05)
    with socket.socket() as other:
        other.bind(("0.0.0.0", block.gcs))
        other.listen()
        (short_tmp / "bound").touch()
        assert started.wait(timeout=30) == ExitCode.FAILED
    assert started.stderr is not None
    said = started.stderr.read()
    assert f"error: port {block.gcs} (--port) taken on n0 while its Ray started" in said, said
    assert (short_tmp / f"n0{node.ENDED_SUFFIX}").read_text().startswith("ports\t")


def test_a_line_to_a_closed_connection_is_dropped_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under PBS_LAUNCHER=ssh a node's stderr is the ssh connection, which may be gone before the
    node's teardown: a node process killed by the broken pipe would leave its Ray running."""
    read, write = os.pipe()
    os.close(read)
    closed = os.fdopen(write, "w")
    monkeypatch.setattr(sys, "stderr", closed)
    say = Say("n0")
    say("stopping this job's Ray on n0")  # BrokenPipeError inside, not out
    assert say.lost == 1
