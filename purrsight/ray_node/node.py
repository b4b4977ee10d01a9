"""One node's Ray for the life of a batch job: up with the job-wide stop signals held, down when told.

A plain ``scancel``, a preemption and ``qdel`` send SIGTERM to every process of the job at
once. Ray's raylets and workers end on it, before the driver could stop the run with a
checkpoint. So ``ray start`` runs with SIGTERM, SIGINT and SIGHUP blocked: a blocked signal
mask survives fork and exec, and every process Ray starts (GCS, raylet, agents, workers, the
job supervisor) keeps them pending and lives on. The driver unblocks them for itself
(purrsight.ray_engine.driver) and stops the run: every worker finishes its step and
checkpoints. This process takes the SIGTERM as "the job is stopping": it keeps Ray up until
the batch script's teardown (SIGUSR2, or the teardown file, for launchers that cannot signal
a remote task) or until ``--stop-grace`` seconds have passed, then takes the whole process
tree down (purrsight.ray_node.processes) and removes the temp dir. Its handlers are in place
before anything else, so a stop during the head's wait or Ray's start is handled too.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import FrameType

from purrsight.errors import ExitCode
from purrsight.launcher.cpus import usable_cpus
from purrsight.parent_death import die_with_parent
from purrsight.ray_node import processes
from purrsight.ray_node.address import node_address
from purrsight.ray_node.ports import PORT_BASE, JobPorts, node_flags, port_free
from purrsight.ray_node.resources import OBJECT_STORE_SHARE, gib, memory_limit, object_store_bytes
from purrsight.ray_node.say import Say
from purrsight.ray_node.temp import MAX_TEMP_DIR, make_temp_dir, wanted

# What a scheduler sends every process of a job to stop it (SLURM: SIGTERM; an interactive
# srun: SIGINT; a dropped ssh: SIGHUP). Held in Ray's processes; this one notes it.
JOB_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
TEARDOWN_SIGNAL = signal.SIGUSR2  # the batch script's own: Ray down now
ENDED_SUFFIX = ".ended"  # <log dir>/<node>.ended: why this node's step ended, for the wait
DOWN_SUFFIX = ".down"  # <log dir>/<node>.down: this node's Ray is down, the teardown's answer (batch/ray_cluster.sh)


class Stop:
    """The signals this node has had: the job's stop (keep Ray up a while), the teardown (now)."""

    def __init__(self) -> None:
        self.job_stop: int | None = None
        self.job_stop_at = 0.0
        self.teardown = False

    def install(self) -> None:
        for sig in JOB_STOP_SIGNALS:
            signal.signal(sig, self._job_stop)
        signal.signal(TEARDOWN_SIGNAL, self._teardown)

    def _job_stop(self, signum: int, _frame: FrameType | None) -> None:
        if self.job_stop is None:
            self.job_stop, self.job_stop_at = signum, time.monotonic()

    def _teardown(self, _signum: int, _frame: FrameType | None) -> None:
        self.teardown = True

    @property
    def asked(self) -> bool:
        return self.teardown or self.job_stop is not None


def record_end(args: argparse.Namespace, reason: str, line: str) -> None:
    """Why this node's step ends early, for the wait: "ports" is nobody's node fault."""
    if args.log_dir:
        Path(args.log_dir, f"{args.name}{ENDED_SUFFIX}").write_text(f"{reason}\t{line}\n")


def record_down(args: argparse.Namespace, left: list[int]) -> None:
    """This node's answer to the teardown: its Ray is down (or the pids it could not stop).

    The batch script keeps its teardown file until every node has answered: under pbsdsh or ssh
    the local client's exit says nothing of the remote task, and a node polling the file on a
    shared filesystem may see it only after its attribute cache expires (about 30 s on NFS).
    """
    if args.log_dir:
        answer = Path(args.log_dir, f"{args.name}{DOWN_SUFFIX}")
        if not answer.exists():  # the first answer stands: start()'s own, then its wrapper's for an early end
            answer.write_text(f"left {left}\n" if left else "down\n")


def wait_for_head(args: argparse.Namespace, gcs: int, address: str, stop: Stop, say: Say) -> bool:
    """Until the head's GCS port answers from here; False after ``--head-wait`` s or a stop."""
    deadline = time.monotonic() + args.head_wait
    told = False
    while not stop.asked:
        try:
            with socket.create_connection((args.head, gcs), timeout=min(5.0, max(0.1, deadline - time.monotonic()))):
                return True
        except OSError as err:
            if time.monotonic() > deadline:
                say(
                    f"error: the head {args.head}:{gcs} is not reachable from {address} after {args.head_wait:.0f} s "
                    "(a firewall, or the wrong interface: set NODE_ADDR)"
                )
                return False
            if not told:
                say(f"waiting for the head at {args.head}:{gcs} ({err.strerror or err})")
                told = True
            time.sleep(1)
    return False


def spawn_with_job_stop_held(command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``command`` started with the job-wide stop signals blocked: it and everything it starts inherit that.

    It runs in a session of its own: a scheduler that stops a job by session (OpenPBS's MoM
    sends qdel's SIGTERM to each task's session) reaches this node process, not its Ray. Ray's
    dashboard, the job server, exits on SIGTERM by a handler of its own whatever the mask, and
    without it the batch script cannot ask the driver to stop the run with a checkpoint.

    It dies with this process (a parent-death SIGKILL): with the stop signals held, a Ray whose
    node process was SIGKILLed would otherwise live on unknown to the scheduler, holding its GPUs.
    ``ray start --block`` takes its daemons down with it (Ray's fate sharing), and they their workers.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_STOP_SIGNALS)
    try:
        # preexec_fn is safe here: the node process runs no other thread (one holding a lock at the
        # fork could hang the child).
        return subprocess.Popen(command, env=env, preexec_fn=die_with_parent, start_new_session=True)
    finally:
        # A stop that came in meanwhile stays pending here and is handled as soon as this returns.
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ray_start_env(args: argparse.Namespace) -> dict[str, str]:
    """``ray start``'s environment. A worker's asks the head's GCS for the head's own node, 20
    times 2 s apart by default: a head whose GCS answers but whose raylet is slower than that to
    register (a loaded node, a slow shared filesystem) failed the worker's start, and the worker's
    node was blamed. It waits as long as it waits for the head's port (``--head-wait``)."""
    env = dict(os.environ)
    if args.role == "worker":
        env.setdefault("RAY_NUM_REDIS_GET_RETRIES", str(max(20, int(args.head_wait / 2))))
    return env


def run_until_stopped(child: subprocess.Popen[bytes], args: argparse.Namespace, stop: Stop, say: Say) -> str:
    """Keep Ray up until it ends, the batch script's teardown, or the grace after the job's stop; why it ended."""
    teardown_file = Path(args.teardown_file) if args.teardown_file else None
    told = False
    while True:
        if child.poll() is not None:
            return f"ray start exited with code {child.returncode}"
        if stop.teardown:
            return "the batch script's teardown"
        if teardown_file is not None and teardown_file.exists():
            return f"the batch script's teardown ({teardown_file})"
        if stop.job_stop is not None:
            name = signal.Signals(stop.job_stop).name
            if not told:
                say(
                    f"{name}: the job is stopping; Ray stays up until the batch script's teardown "
                    f"(at most {args.stop_grace:.0f} s) so the driver can stop the run with a checkpoint"
                )
                told = True
            if time.monotonic() - stop.job_stop_at > args.stop_grace:
                return f"{name}, and no teardown within {args.stop_grace:.0f} s"
        processes.reap_adopted(os.getpid(), keep={child.pid})
        time.sleep(0.5)


def start(args: argparse.Namespace) -> int:
    """One node's Ray until the teardown; whatever ends it (a failed start too) answers the teardown."""
    try:
        return _start(args)
    finally:
        record_down(args, [])


def _start(args: argparse.Namespace) -> int:
    stop = Stop()
    stop.install()  # first: a stop during the head's wait or Ray's start must find its handler
    say = Say(args.name)
    if len(str(wanted(args.job, args.slot, args.temp_root))) + len("-xxxxxxxx") > MAX_TEMP_DIR:
        say(
            f"error: Ray's temp dir {wanted(args.job, args.slot, args.temp_root)} is too long for its socket paths: "
            "set RAY_TMP_ROOT to a short folder such as /tmp"
        )
        return ExitCode.USAGE
    ports = JobPorts(args.ports)
    address = node_address(args.hint, None if args.role == "head" else args.head)
    cpus, cpu_source = usable_cpus(os.environ)
    memory, memory_source = memory_limit(os.environ, cpus, args.gpus)
    shm = shutil.disk_usage("/dev/shm").free if Path("/dev/shm").is_dir() else 0
    store = object_store_bytes(memory, shm)
    say(
        f"{args.role} at {address}: {cpus} CPUs ({cpu_source}), {args.gpus} GPUs ({args.gpu_source}), "
        f"object store {gib(store)} ({OBJECT_STORE_SHARE:.0%} of {gib(memory)} from {memory_source}; "
        f"/dev/shm has {gib(shm)} free)"
    )
    if store > shm:
        say(f"warning: /dev/shm has {gib(shm)} free, less than the object store: Ray falls back to disk (slow)")
    command = [args.ray, "start", "--block", "--disable-usage-stats"]
    command += ["--node-ip-address", address, "--node-name", args.name]
    command += ["--num-cpus", str(cpus), "--num-gpus", str(args.gpus), "--object-store-memory", str(store)]
    if args.role == "head":
        taken = [f"{port} ({flag})" for flag, port in ports.head().items() if not port_free(port)]
        if taken:
            line = (
                f"error: the head's port {', '.join(taken)} was taken on {args.name} after the job chose its block "
                "(another job or service): no node is at fault"
            )
            say(line)
            record_end(args, "ports", line)
            return ExitCode.FAILED  # not 3: nothing wrong with the job or a node, a requeue may find the ports free
        command += ["--head", "--dashboard-host", address]
        command += [item for flag, port in ports.head().items() for item in (flag, str(port))]
    elif wait_for_head(args, ports.gcs, address, stop, say):
        command += ["--address", f"{args.head}:{ports.gcs}"]
    elif stop.asked:
        say("stopped before Ray started")
        return 0
    else:
        return ExitCode.CLUSTER

    def moved(flag: str, port: int, instead: int) -> None:
        say(f"port {port} ({flag}) is in use on {args.name}: using {instead}")

    try:
        command += node_flags(ports, args.slot, args.port_range, moved=moved)
    except OSError as err:
        say(f"error: {err} on {args.name}; no node is at fault")
        record_end(args, "ports", str(err))
        return ExitCode.FAILED
    temp = make_temp_dir(args.job, args.slot, args.temp_root, say)
    command += ["--temp-dir", str(temp)]
    say(f"temp dir {temp}")
    processes.become_subreaper()
    child = spawn_with_job_stop_held(command, ray_start_env(args))
    why = run_until_stopped(child, args, stop, say)
    say(f"stopping this job's Ray on {args.name} ({why})")
    left = processes.kill_tree(os.getpid())
    if left:
        say(f"could not stop pids {left} of this job's Ray")
    shutil.rmtree(temp, ignore_errors=True)
    record_down(args, left)
    if stop.asked:
        return 0  # asked to stop: the batch script's teardown, not a failure
    if child.returncode:
        # Another job or service may have bound one of the probed ports before Ray did: Ray then
        # exits at once. Its processes are gone by now, so a port still taken is someone else's.
        taken = [f"{port} ({flag})" for flag, port in asked_ports(command) if not port_free(port)]
        if taken:
            line = f"error: port {', '.join(taken)} taken on {args.name} while its Ray started (another job or service)"
            line += ": no node is at fault"
            say(line)
            record_end(args, "ports", line)
            return ExitCode.FAILED
        return ExitCode.CLUSTER
    return 0


def asked_ports(command: list[str]) -> list[tuple[str, int]]:
    """The (flag, port) pairs a ``ray start`` command asks for; 0 (the kernel's pick) left out."""
    return [
        (flag, int(value))
        for flag, value in itertools.pairwise(command)
        if flag.startswith("--") and flag.endswith("port") and value.isdigit() and int(value) > 0
    ]


def add_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("role", choices=("head", "worker"))
    run.add_argument("--job", required=True, help="the batch job's id (the temp dir follows from it)")
    run.add_argument("--ports", type=int, required=True, help="the job's port block (`ports` prints it)")
    run.add_argument("--slot", type=int, required=True, help="the node's index in the job (its ports and temp dir)")
    run.add_argument("--name", required=True, help="the node's name in the scheduler (shown by Ray and in the logs)")
    run.add_argument("--hint", help="the scheduler's address or host name for this node")
    run.add_argument("--head", help="the head's address (workers)")
    run.add_argument("--gpus", type=int, default=0)
    run.add_argument("--gpu-source", default="none given")
    run.add_argument("--temp-root", default=os.environ.get("RAY_TMP_ROOT", "/tmp"))
    run.add_argument("--head-wait", type=float, default=300.0, help="seconds a worker waits for the head (default: %(default)s)")
    run.add_argument("--stop-grace", type=float, default=300.0, help="seconds Ray outlives the job's SIGTERM without a teardown")
    run.add_argument("--teardown-file", help="a file whose appearance asks for the teardown (launchers that cannot signal)")
    run.add_argument("--log-dir", help="where this node records why its step ended early (<node>.ended) and its end (<node>.down)")
    run.add_argument("--ray", default=shutil.which("ray") or "ray")
    run.set_defaults(port_range=int(os.environ.get("RAY_PORT_BASE", PORT_BASE)))
