"""This job's Ray on one node of a batch allocation: its ports, temp dir, address and size.

What slurm/ray.sbatch and pbs/ray.pbs run through batch/ray_cluster.sh (docs/SCHEDULERS.md):

    python -m purrsight.launcher.ray_node check-config CONFIG [section.key=value ...]
    python -m purrsight.launcher.ray_node address [--hint ADDR] [--head ADDR]
    python -m purrsight.launcher.ray_node start head|worker --job JOB --slot K --name NODE ...
    python -m purrsight.launcher.ray_node wait --job JOB --head ADDR --nodes NODE[,NODE...] ...

Every port and the temp dir follow from the job id (and the node's slot in the job), so two
jobs sharing nodes never meet; ``start`` runs ``ray start --block`` and, however it ends,
stops this node's Ray of this job only (by its temp dir, never ``ray stop``, which stops every
Ray on the node). The node's size: ray_node_size; the wait: ray_wait.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from purrsight.errors import ExitCode
from purrsight.launcher import network
from purrsight.launcher.ray_node_size import OBJECT_STORE_SHARE, cpu_count, gib, memory_limit, object_store_bytes

# A job's fixed ports: a block of 100 in 10000-19999 (RAY_PORT_BASE moves it). Below Linux's
# ephemeral range, where an outgoing connection could take a port before Ray binds it, and
# below the launcher's MASTER_PORT (20000 + job id % 20000), so a Ray job and a torchrun job
# sharing a node do not meet either.
PORT_BASE = 10000
BLOCK = 100  # ports per job: the head's 3, then 6 per node slot
JOB_SLOTS = 100  # jobs whose ids differ by a multiple of this share a block (only a clash if they share a node)
HEAD_PORTS = ("--port", "--dashboard-port", "--ray-client-server-port")
NODE_PORTS = (
    "--node-manager-port",
    "--object-manager-port",
    "--dashboard-agent-grpc-port",
    "--dashboard-agent-listen-port",
    "--metrics-export-port",
    "--runtime-env-agent-port",
)
NODE_SLOTS = (BLOCK - 4) // len(NODE_PORTS)  # 16: nodes further apart share ports, on different hosts
MAX_TEMP_DIR = 40  # Ray's socket paths add ~60 bytes below the temp dir; a Unix socket path holds 107


@dataclass(frozen=True)
class JobPorts:
    """The ports of one job's Ray: the head's and those of the node in ``slot``."""

    base: int

    @classmethod
    def of(cls, job: str, base: int = PORT_BASE) -> JobPorts:
        number = int("".join(ch for ch in job.split(".", 1)[0] if ch.isdigit()) or 0)  # "4242.server" -> 4242
        return cls(base + (number % JOB_SLOTS) * BLOCK)

    @property
    def gcs(self) -> int:
        return self.base

    @property
    def dashboard(self) -> int:
        return self.base + 1

    def head_flags(self) -> list[str]:
        return [item for offset, flag in enumerate(HEAD_PORTS) for item in (flag, str(self.base + offset))]

    def node_flags(self, slot: int) -> list[str]:
        first = self.base + 4 + (slot % NODE_SLOTS) * len(NODE_PORTS)
        # Worker processes take ports the kernel picks (0): free by construction, no block needed.
        flags = ["--min-worker-port", "0", "--max-worker-port", "0"]
        return flags + [item for offset, flag in enumerate(NODE_PORTS) for item in (flag, str(first + offset))]


def temp_dir(job: str, slot: int, root: str = "/tmp") -> Path:
    """This node's Ray temp dir: short (Ray's socket paths must fit 107 bytes) and the job's own."""
    return Path(root) / f"prs-{job}-{slot}"


def is_local(address: str) -> bool:
    """Whether this machine holds ``address`` (can bind it): the scheduler's address of *this* node."""
    try:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
        return True
    except OSError:
        return False


def node_address(hint: str | None, head: str | None) -> str:
    """The address this node's Ray announces, chosen as the launcher chooses NCCL's interface.

    NODE_ADDR wins; then the scheduler's own address of this node, when this machine holds it;
    then the source address of the route to the head (the interface the other nodes reach us
    on); the head without a hint uses its host name's address.
    """
    if os.environ.get("NODE_ADDR"):
        return os.environ["NODE_ADDR"]
    if hint:
        try:
            resolved = network.resolve(hint)
        except OSError:
            resolved = ""
        if resolved and is_local(resolved):
            return resolved
    if head:
        route = network.route_to(network.resolve(head))
        if route and route.source:
            return route.source
    return network.resolve(socket.gethostname())


# --- start and stop --------------------------------------------------------------------------


def ray_processes(temp: Path) -> list[int]:
    """Pids of the processes that name ``temp`` on their command line: this job's Ray on this node."""
    mine = os.getpid()
    # The dir as a whole argument or value ("--temp-dir D", "--session-dir=D/session_..."), not a prefix of another job's.
    named = re.compile(re.escape(str(temp).encode()) + rb"(?=[/\x00]|$)")
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == mine:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if named.search(cmdline) and b"purrsight.launcher.ray_node" not in cmdline:
            pids.append(int(entry.name))
    return pids


def teardown(temp: Path, say: Say, grace_s: float = 5.0) -> None:
    """Stop this job's Ray on this node (SIGTERM, then SIGKILL after ``grace_s``) and remove its temp dir."""
    pids = ray_processes(temp)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5)
        while (pids := ray_processes(temp)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not pids:
            break
    if pids:
        say(f"could not stop pids {pids} of this job's Ray")
    shutil.rmtree(temp, ignore_errors=True)


class Say:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, line: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"{stamp} [ray_node {self.name}] {line}", file=sys.stderr, flush=True)


def start(args: argparse.Namespace) -> int:
    say = Say(args.name)
    ports = JobPorts.of(args.job, args.port_base)
    temp = temp_dir(args.job, args.slot, args.temp_root)
    if len(str(temp)) > MAX_TEMP_DIR:
        say(f"error: Ray's temp dir {temp} is too long for its socket paths: set RAY_TMP_ROOT to a short folder such as /tmp")
        return ExitCode.USAGE
    address = node_address(args.hint, None if args.role == "head" else args.head)
    cpus, cpu_source = cpu_count()
    memory, memory_source = memory_limit()
    shm = shutil.disk_usage("/dev/shm").free if Path("/dev/shm").is_dir() else 0
    store = object_store_bytes(memory, shm)
    say(
        f"{args.role} at {address}: {cpus} CPUs ({cpu_source}), {args.gpus} GPUs ({args.gpu_source}), "
        f"object store {gib(store)} ({OBJECT_STORE_SHARE:.0%} of {gib(memory)} from {memory_source}; "
        f"/dev/shm has {gib(shm)} free); temp dir {temp}"
    )
    if store > shm:
        say(f"warning: /dev/shm has {gib(shm)} free, less than the object store: Ray falls back to disk (slow)")
    command = [args.ray, "start", "--block", "--disable-usage-stats", "--temp-dir", str(temp)]
    command += ["--node-ip-address", address, "--node-name", args.name]
    command += ["--num-cpus", str(cpus), "--num-gpus", str(args.gpus), "--object-store-memory", str(store)]
    command += ports.node_flags(args.slot)
    if args.role == "head":
        command += ["--head", "--dashboard-host", address, *ports.head_flags()]
    else:

        def waiting(err: OSError) -> None:
            say(f"waiting for the head at {args.head}:{ports.gcs} ({err.strerror or err})")

        try:
            network.await_port(args.head, ports.gcs, args.head_wait, waiting=waiting)
        except OSError:
            say(
                f"error: the head {args.head}:{ports.gcs} is not reachable from {address} after {args.head_wait:.0f} s "
                "(a firewall, or the wrong interface: set NODE_ADDR)"
            )
            return ExitCode.CLUSTER
        command += ["--address", f"{args.head}:{ports.gcs}"]
    if temp.exists():  # a run of this job before a requeue, ended without its teardown
        teardown(temp, say)
    temp.mkdir(mode=0o700, parents=True)

    child = subprocess.Popen(command)
    stopping: list[int] = []

    def on_signal(sig: int, _frame: object) -> None:
        stopping.append(sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    while child.poll() is None and not stopping:
        time.sleep(0.5)
    code = child.poll()
    why = f"SIG{signal.Signals(stopping[0]).name[3:]}" if stopping else f"ray start exited with code {code}"
    say(f"stopping this job's Ray on {args.name} ({why})")
    teardown(temp, say)
    if stopping:
        return 0  # asked to stop: the batch script's teardown, not a failure
    return ExitCode.CLUSTER if code else 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m purrsight.launcher.ray_node", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--job", default="0", help="the batch job's id: every port and the temp dir follow from it")
    common.add_argument("--port-base", type=int, default=int(os.environ.get("RAY_PORT_BASE", PORT_BASE)))
    check = commands.add_parser("check-config", help="validate the config before any Ray starts (exit 2 naming each problem)")
    check.add_argument("config")
    check.add_argument("overrides", nargs="*")
    address = commands.add_parser("address", help="print the address this node's Ray announces")
    address.add_argument("--hint", help="the scheduler's address or host name for this node")
    address.add_argument("--head", help="the head's address (workers: the route to it picks the interface)")
    run = commands.add_parser("start", parents=[common], help="run this job's Ray on this node until stopped")
    run.add_argument("role", choices=("head", "worker"))
    run.add_argument("--slot", type=int, required=True, help="the node's index in the job (its ports and temp dir)")
    run.add_argument("--name", required=True, help="the node's name in the scheduler (shown by Ray and in the logs)")
    run.add_argument("--hint", help="the scheduler's address or host name for this node")
    run.add_argument("--head", help="the head's address (workers)")
    run.add_argument("--gpus", type=int, default=0)
    run.add_argument("--gpu-source", default="none given")
    run.add_argument("--temp-root", default=os.environ.get("RAY_TMP_ROOT", "/tmp"))
    run.add_argument("--head-wait", type=float, default=300.0, help="seconds a worker waits for the head (default: %(default)s)")
    run.add_argument("--ray", default=shutil.which("ray") or "ray")
    waits = commands.add_parser("wait", parents=[common], help="wait for every node of the job, with a deadline")
    waits.add_argument("--head", required=True)
    waits.add_argument("--nodes", required=True, help="the node names, comma-separated")
    waits.add_argument("--gpus-per-node", type=int, default=0)
    waits.add_argument("--deadline", type=float, default=600.0)
    waits.add_argument("--watch", action="append", default=[], help="NODE=PID: the node's step; its end fails the wait")
    waits.add_argument("--log-dir", default="logs")
    args = parser.parse_args(argv)
    if args.command == "start" and args.role == "worker" and not args.head:
        parser.error("a worker needs --head")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "check-config":
        from purrsight.config import ConfigError, load_config

        try:
            load_config(args.config, args.overrides)
        except ConfigError as err:
            err.print_problems()
            return ExitCode.USAGE
        return 0
    if args.command == "address":
        print(node_address(args.hint, args.head))
        return 0
    if args.command == "start":
        return start(args)
    from purrsight.launcher.ray_wait import wait  # it imports this module (and Ray)

    return wait(args)


if __name__ == "__main__":
    sys.exit(main())
