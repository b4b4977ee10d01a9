"""A real three-node SLURM cluster on this machine, started for the tests and torn down after.

munged, slurmctld and three slurmd daemons (`slurmd -N node0` ... `node2`) run from
Debian's slurm-wlm and munge, with their own config, key, state and logs in a temporary
folder, distinct ports, and each node at an address of its own on loopback (127.0.1.1-3: Ray
needs one per node). Jobs take two nodes; the
third lets a job that excludes a bad node run again on two good ones. Nothing is faked. A daemon
that does not start fails the test (with its log), it never skips it.

`cred_expire=15` (default 120) shortens SLURM's wait before a requeued job may start again.
That wait is what keeps the new run's launch credential from being taken for the old run's
revoked one, so the tests wait it out rather than forcing an earlier start (`scontrol update
StartTime=now` raced it and failed the restarted job now and then).

`bf_interval=5,sched_interval=5` (defaults 30 and 60): a requeued job, once its hold is over,
waits for the scheduler's next pass; five seconds keeps that wait short.

`BatchStartTimeout=60` and `MessageTimeout=30` (defaults 10 and 10): these tests run beside
the rest of the suite on two cores, where a batch script's launch or an RPC can take longer
than 10 s; SLURM then requeues a job it is still starting, which no test asks for.

PBS over the same cluster (Debian's slurm-wlm-torque: `qsub`, `qdel`, `qrerun` call SLURM):
the `spank_pbs` plugin sets PBS_JOBID, PBS_O_WORKDIR, PBS_NODENUM and the other PBS_* variables
in every job, and a TaskProlog gives each task a PBS_NODEFILE of one line per slot
(`generate_pbs_nodefile`), as a site that runs PBS scripts on SLURM configures it. The node
names resolve to their addresses through /etc/hosts (lines added for the session, then removed),
as a cluster's host names do: PBS scripts know their nodes by name only. Ours go first, so a
machine whose /etc/hosts already maps those names (another test cluster did) still resolves
them to this cluster's addresses; the fixture checks that they do.

CPUs are bound as sites bind them: `TaskPlugin=task/affinity` gives each step the CPUs it asked
for and no more (a step that asks for none gets one), so a script that forgets
`--cpus-per-task` on an srun step shows it here. Processes are tracked by cgroup where this
machine allows it (`proctrack/cgroup` on a writable cgroup v1 freezer hierarchy, the one this
VM has, root being needed to write it): every process of a step, a renamed or reparented
one included, is signalled and killed with its step. On cgroup v2 SLURM 22.05 wants systemd
to delegate it a subtree (dbus), which a container without systemd cannot give: there the
cluster tracks by process tree (`proctrack/linuxproc`), which misses a process that leaves it
(a double fork), and says so at start.

A second partition, `urgent`, holds the same nodes at a higher priority tier
(`PreemptType=preempt/partition_prio`, `PreemptMode=REQUEUE`): a job there preempts a `debug`
job on its nodes as a site takes nodes back, SIGTERM to every process of the job, SIGKILL after
KillWait, and SLURM requeues the preempted job.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import free_port

SLURM_CONF = """\
ClusterName=purrsight-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.sock,cred_expire=15
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType={proctrack}
TaskPlugin=task/affinity
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5,sched_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MinJobAge=3600
KillWait=60
BatchStartTimeout=60
MessageTimeout=30
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
PlugStackConfig={root}/plugstack.conf
TaskProlog={root}/task_prolog.sh
NodeName=node0 NodeHostname=node0 NodeAddr={node0_addr} Port={node0_port} CPUs=2 RealMemory=4000 State=UNKNOWN
NodeName=node1 NodeHostname=node1 NodeAddr={node1_addr} Port={node1_port} CPUs=2 RealMemory=4000 State=UNKNOWN
NodeName=node2 NodeHostname=node2 NodeAddr={node2_addr} Port={node2_port} CPUs=2 RealMemory=4000 State=UNKNOWN
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
PartitionName=debug Nodes=node0,node1,node2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES PriorityTier=1
PartitionName=urgent Nodes=node0,node1,node2 Default=NO MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""

# Only the freezer (proctrack) is used: no memory or CPU limits of SLURM's over the machine's.
CGROUP_CONF = """\
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainSwapSpace=no
ConstrainDevices=no
"""
FREEZER = Path("/sys/fs/cgroup/freezer")


def process_tracking() -> tuple[str, str]:
    """(ProctrackType, why): cgroup where a cgroup v1 freezer hierarchy is mounted and writable here."""
    probe = FREEZER / f"purrsight-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as err:
        why = "no cgroup v1 freezer hierarchy" if not FREEZER.is_dir() else f"cannot write {FREEZER} ({err.strerror})"
        return "proctrack/linuxproc", f"{why}; SLURM 22.05's cgroup v2 plugin needs systemd's delegation"
    return "proctrack/cgroup", f"{FREEZER} is writable"


SPANK_PBS = "/usr/lib/x86_64-linux-gnu/slurm-wlm/spank_pbs.so"

# A TaskProlog's "export NAME=VALUE" lines set NAME in the task. Once per job, shared by its
# tasks and its requeues' (generate_pbs_nodefile writes a new temporary file each call).
TASK_PROLOG = """\
#!/bin/sh
nodefile="{root}/nodefiles/$SLURM_JOB_ID"
[ -s "$nodefile" ] || cp "$(generate_pbs_nodefile)" "$nodefile"
echo "export PBS_NODEFILE=$nodefile"
"""

# Three nodes: jobs take two, so a job that excludes a bad node still finds two good ones.
NODES = ("node0", "node1", "node2")
NODE_ADDRS = {node: f"127.0.1.{i + 1}" for i, node in enumerate(NODES)}
ETC_HOSTS = Path("/etc/hosts")
HOSTS_MARK = "# purrsight test cluster"


@contextlib.contextmanager
def node_names_resolve() -> Iterator[None]:
    """node0-node2 in /etc/hosts for the session (PBS scripts reach their hosts by name), ahead of
    any other line for them: the resolver takes the first match."""
    original = ETC_HOSTS.read_text()
    kept = "".join(line for line in original.splitlines(keepends=True) if HOSTS_MARK not in line)
    lines = "".join(f"{addr} {node} {HOSTS_MARK}\n" for node, addr in NODE_ADDRS.items())
    ETC_HOSTS.write_text(lines + kept)
    try:
        yield
    finally:
        ETC_HOSTS.write_text(kept)


def check_node_names() -> None:
    for node, addr in NODE_ADDRS.items():
        resolved = subprocess.run(["getent", "hosts", node], capture_output=True, text=True, timeout=10).stdout.split()
        if resolved[:1] != [addr]:
            pytest.fail(f"{node} resolves to {resolved[:1]}, not to {addr} that /etc/hosts names first (nsswitch.conf?)")


# What SLURM's clients say when the controller is too busy to answer (not "Invalid job id": that is an answer).
BUSY_CONTROLLER = ("timed out", "unable to contact", "zero bytes were transmitted", "connection refused", "try again")


@dataclass
class SlurmCluster:
    root: Path
    env: dict[str, str]

    def run(self, *args: str, check: bool = True) -> str:
        # A query is asked again when the controller is too busy to answer (CI's loaded machine:
        # "Socket timed out on send/recv operation"); a command that changes a job is asked once.
        query = args[0] in ("squeue", "sinfo") or args[:2] == ("scontrol", "show")
        tries = 5 if query else 1
        for attempt in range(tries):
            done = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=60)
            busy = any(text in done.stderr.lower() for text in BUSY_CONTROLLER)
            if done.returncode == 0 or not busy or attempt == tries - 1:
                break
            time.sleep(2)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed: {done.stderr}")
        return done.stdout

    def job_field(self, job_id: str, field: str) -> str:
        for item in self.run("scontrol", "show", "job", job_id, "-o").split():
            key, _, value = item.partition("=")
            if key == field:
                return value
        return ""

    def wait_state(self, job_id: str, states: set[str], timeout: float, poll_s: float = 2.0) -> str:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_field(job_id, "JobState")
            if state in states:
                return state
            time.sleep(poll_s)
        raise AssertionError(f"job {job_id} still {state} after {timeout} s; slurmctld log:\n{self.log('slurmctld')}")

    def log(self, name: str) -> str:
        path = self.root / "log" / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else f"(no {path})"


def _start(args: list[str], env: dict[str, str], what: str, root: Path) -> None:
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in (root / "log").glob("*.log"))
        pytest.fail(f"{what} did not start (exit {done.returncode}): {done.stderr}\n{logs}")


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with running_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def no_job_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test on the cluster, its jobs are cancelled and gone: one a failed test left
    running (held at a gate, or training on) would take the nodes the next test's jobs need, and
    that test would fail waiting for them."""
    yield
    if "slurm" not in request.fixturenames:
        return
    cluster: SlurmCluster = request.getfixturevalue("slurm")
    if cluster.run("squeue", "-h", check=False).strip():
        drain(cluster)


def drain(cluster: SlurmCluster, timeout: float = 90) -> None:
    """Cancel every job and wait (up to KillWait and a margin) until their steps have ended."""
    cluster.run("scancel", "--partition=debug", check=False)
    cluster.run("scancel", "--partition=urgent", check=False)
    deadline = time.monotonic() + timeout
    while cluster.run("squeue", "-h", check=False).strip() and time.monotonic() < deadline:
        time.sleep(1)


@contextlib.contextmanager
def running_cluster(root: Path) -> Iterator[SlurmCluster]:
    """The cluster in ``root`` (an empty folder), for the session's tests or a benchmark."""
    for tool in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "qsub", "generate_pbs_nodefile"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed: scripts/test.sh installs slurm-wlm, slurm-wlm-torque and munge (as root)")
    for folder in ("state", "spool", "log", "nodefiles"):
        (root / folder).mkdir()
    (root / "plugstack.conf").write_text(f"required {SPANK_PBS}\n")
    (root / "task_prolog.sh").write_text(TASK_PROLOG.format(root=root))
    (root / "task_prolog.sh").chmod(0o755)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    proctrack, why = process_tracking()
    print(f"test cluster: {proctrack} ({why})")
    if proctrack == "proctrack/cgroup":
        (root / "cgroup.conf").write_text(CGROUP_CONF)
    (root / "slurm.conf").write_text(
        SLURM_CONF.format(
            root=root,
            proctrack=proctrack,
            ctld_port=free_port(),
            **{f"{node}_port": free_port() for node in NODES},
            **{f"{node}_addr": addr for node, addr in NODE_ADDRS.items()},
        )
    )
    env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))
    _start(
        [
            "munged",
            "--force",
            f"--socket={root}/munge.sock",
            f"--key-file={key}",
            f"--log-file={root}/log/munged.log",
            f"--pid-file={root}/munged.pid",
            f"--seed-file={root}/munged.seed",
        ],
        env,
        "munged",
        root,
    )
    _start(["slurmctld", "-i"], env, "slurmctld", root)
    for node in NODES:
        _start(["slurmd", "-N", node], env, f"slurmd {node}", root)
    cluster = SlurmCluster(root, env)
    deadline = time.monotonic() + 60
    while "idle" not in cluster.run("sinfo", "-h", "-o", "%T", check=False) or cluster.run(
        "sinfo", "-h", "-N", "-o", "%T", check=False
    ).split().count("idle") < len(NODES):
        if time.monotonic() > deadline:
            pytest.fail(f"SLURM nodes never became idle: {cluster.run('sinfo', check=False)}\n{cluster.log('slurmctld')}")
        time.sleep(1)
    with node_names_resolve():
        check_node_names()
        yield cluster
        # Jobs a benchmark or a failed test left running: their processes must not outlive the daemons.
        drain(cluster)
        for pid_file in [*root.glob("slurmd-*.pid"), root / "slurmctld.pid", root / "munged.pid"]:
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text().strip()), 15)
