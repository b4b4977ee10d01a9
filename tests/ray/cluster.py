"""A real two-node Ray cluster on this machine: two `ray start --block` processes (tests and bench).

The head listens on 127.0.0.2 and the worker node on 127.0.0.3, each with its own temp dir
(on one address and one temp dir Ray would see a single node). Token authentication is
on, as our README asks of users. Each node is stopped by its pid and its descendants',
never with `ray stop`, which stops every Ray process on the machine.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.helpers import REPO, free_port, python_env

HEAD_ADDR, WORKER_ADDR = "127.0.0.2", "127.0.0.3"
RAY = str(REPO / ".venv" / "bin" / "ray") if (REPO / ".venv" / "bin" / "ray").exists() else "ray"
NODE_RESOURCES = ("--num-cpus", "1", "--num-gpus", "0")  # each node's, the head's and the worker node's
STOP_WAIT_S = "60"  # how long `ray job stop` lets the driver checkpoint before SIGKILL (head's env)


class RayCluster:
    def __init__(self, root: Path) -> None:
        self.root = root  # short: Ray's socket paths must fit in 107 bytes
        self.token = secrets.token_hex(16)
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        self.nodes: list[psutil.Process] = []

    @property
    def dashboard(self) -> str:
        return f"http://{HEAD_ADDR}:{self.dashboard_port}"

    def env(self, **extra: str) -> dict[str, str]:
        env = python_env()
        env.pop("RAY_ADDRESS", None)
        env.update(
            {
                "PATH": f"{REPO / '.venv' / 'bin'}:{env['PATH']}",
                "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": self.token,
                "RAY_USAGE_STATS_ENABLED": "0",
                "OMP_NUM_THREADS": "1",
                **extra,
            }
        )
        return env

    def _start(self, name: str, args: list[str], env: dict[str, str]) -> None:
        log = (self.root / f"{name}.log").open("w")
        proc = subprocess.Popen(
            [RAY, "start", "--block", "--disable-usage-stats", "--temp-dir", str(self.root / name), *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.nodes.append(psutil.Process(proc.pid))

    @staticmethod
    def node_ports() -> list[str]:
        """Free ports for what listens on fixed defaults (the agent's 52365, ...): a leftover
        node of another run, or a user's own Ray, must not make this one fail to start."""
        ports = ["--min-worker-port", "0", "--max-worker-port", "0"]
        fixed = ["--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port"]
        fixed.append("--runtime-env-agent-port")
        for flag in fixed:
            ports += [flag, str(free_port())]
        return ports

    def start(self) -> None:
        self._start(
            "head",
            [
                "--head",
                "--node-ip-address",
                HEAD_ADDR,
                "--port",
                str(self.gcs_port),
                "--dashboard-host",
                HEAD_ADDR,
                "--dashboard-port",
                str(self.dashboard_port),
                "--ray-client-server-port",
                str(free_port()),
                *NODE_RESOURCES,
                *self.node_ports(),
            ],
            self.env(RAY_JOB_STOP_WAIT_TIME_S=STOP_WAIT_S),
        )
        self.wait_for_nodes(1, timeout=120)
        self.start_worker_node()
        self.wait_for_job_agent(timeout=120)

    def start_worker_node(self) -> None:
        """The second node (again, after a test killed it: Ray counts the new one as a new node)."""
        worker = ["--address", f"{HEAD_ADDR}:{self.gcs_port}", "--node-ip-address", WORKER_ADDR]
        self._start("node1", [*worker, *NODE_RESOURCES, *self.node_ports()], self.env())
        self.nodes[1:] = self.nodes[-1:]  # a killed node's entry is replaced
        self.wait_for_nodes(2, timeout=120)

    def kill_worker_node(self) -> None:
        """The second node lost whole: its `ray start`, raylet, agents and workers, SIGKILL at once."""
        kill_nodes(self.nodes[1:])

    def wait_for_nodes(self, count: int, timeout: float) -> None:
        """Until the head reports ``count`` nodes alive: asked by one child that imports Ray once
        and asks every second (a `ray status` a poll cost 2 CPU-seconds each, and under the full
        suite's load the polls took this start to 90 s)."""
        waiter = subprocess.Popen(
            [sys.executable, "-c", NODES_UP, str(count), self.dashboard],
            cwd=REPO, env=self.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        try:
            while waiter.poll() is None:
                if not all(node.is_running() for node in self.nodes):
                    logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in self.root.glob("*.log"))
                    raise RuntimeError(f"a ray start process exited:\n{logs}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Ray cluster did not reach {count} nodes in {timeout:.0f} s")
                time.sleep(0.5)
            if waiter.returncode != 0:
                raise RuntimeError(f"the node count failed:\n{waiter.communicate()[1][-2000:]}")
        finally:
            waiter.kill()
            waiter.communicate()

    def wait_for_job_agent(self, timeout: float) -> None:
        """The job server takes submissions only once the head's agent has registered with it."""
        deadline = time.monotonic() + timeout
        while True:
            probe = self.job("submit", "--", "python", "-c", "pass", timeout=120)
            if probe.returncode == 0:
                return
            if "No available agent" not in probe.stderr or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray job server does not take jobs:\n{probe.stderr[-2000:]}")
            time.sleep(2)

    def job(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """``ray job ARGS`` against this cluster's job server."""
        return subprocess.run(
            [RAY, "job", *args[:1], "--address", self.dashboard, *args[1:]],
            cwd=REPO,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def submit(
        self, *train_args: str, no_wait: bool = False, timeout: float = 600, env_vars: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """The README's submit command: the repo as working dir, train_phase2.py --engine ray;
        ``env_vars`` in the job's runtime env (its driver, Ray Train's controller and workers)."""
        wait = ["--no-wait"] if no_wait else []
        extra = ["--runtime-env-json", json.dumps({"env_vars": env_vars})] if env_vars else []
        entry = ["python", "train_phase2.py", "--engine", "ray", *train_args]
        return self.job("submit", *wait, *extra, "--working-dir", ".", "--", *entry, timeout=timeout)

    def submit_and_follow(self, *train_args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        """docs/RAY.md's scriptable submit: our wrapper, which exits with the driver's code."""
        return subprocess.run(
            [sys.executable, "-m", "purrsight.ray_engine.submit", "--address", self.dashboard, "--", *train_args],
            cwd=REPO,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def stop(self) -> None:
        kill_nodes(self.nodes)


def kill_nodes(nodes: list[psutil.Process]) -> None:
    """SIGKILL to each ``ray start --block`` and every process under it, then their end."""
    processes = []
    for node in nodes:
        try:
            processes += [node, *node.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(processes, timeout=30)


# The head's count of alive nodes, asked until it reaches argv[1] (its dashboard may not answer yet).
NODES_UP = """
import sys, time
from purrsight.ray_node.wait import alive_nodes
while True:
    try:
        if len(alive_nodes(sys.argv[2])) >= int(sys.argv[1]):
            break
    except Exception:
        pass
    time.sleep(1)
"""


def submission_id(output: str) -> str:
    for word in output.replace("'", " ").split():
        if word.startswith("raysubmit_"):
            return word
    raise AssertionError(f"no job id in:\n{output}")


JOB_INFO = """
import json, sys
from ray.job_submission import JobSubmissionClient
info = JobSubmissionClient(sys.argv[1]).get_job_info(sys.argv[2])
print(json.dumps(info.dict(), default=str))
"""


def job_info(cluster: RayCluster, job_id: str) -> dict[str, object]:
    """The job's details as the job server reports them (status, driver exit code).

    In a child process: Ray's client reads the token settings once per process.
    """
    shown = subprocess.run(
        [sys.executable, "-c", JOB_INFO, cluster.dashboard, job_id],
        env=cluster.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return dict(json.loads(shown.stdout.strip().splitlines()[-1]))
