"""The launcher's cost against the number of nodes: 1, 2, 4, 8, 16 "nodes" on this machine.

Each node is one ``cluster_train.sh`` with one worker process (gloo, one thread), all on
loopback, training the tiny default; with ``--namespaces N`` also N nodes as network
namespace hosts with addresses of their own (tests/network_hosts.py, needs root). Per node
count, two jobs:

- clean: ``--steps`` steps. Read from it: the last launcher's start -> the job's first
  optimizer step; each node's ready time (launcher start -> torchrun starts: probe, config
  check, health checks), health-check time and rendezvous time (torchelastic's own timing,
  logged by purrsight.launcher.torchrun); each node's log bytes; CPU seconds per node by
  part of the stack (bench/common.py).
- fault: the same job, and the worker of the last node is killed (SIGKILL) after step
  ``--kill-after``; read: kill -> the first optimizer step after the restart, and the
  restart's rendezvous time.

All nodes share this machine's cores, so wall times grow with the node count for a reason
real nodes do not have; the CPU seconds per node are what one node spends on its own.

    .venv/bin/python -m bench.scale.node_scaling --nodes 1 2 4 8 16 --namespaces 4   # repository root, as root
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from bench.common import (
    REPO,
    ROLES,
    TINY_CONFIG,
    ProcessTreeCPU,
    bench_env,
    ensure_synthetic_set,
    free_port,
    machine,
    role_of,
    telemetry_step_times,
)
from tests.network_hosts import Host, network_hosts

NODE_READY = re.compile(r"node ready after ([\d.]+) s")
HEALTH = re.compile(r"health checks took ([\d.]+) s")
RENDEZVOUS = re.compile(r"\[torchrun\] rendezvous (\d+) done in ([\d.]+) s")


@dataclass
class JobTimes:
    nodes: int
    network: str  # loopback | namespaces
    first_step_s: float  # the last launcher's start -> the job's first optimizer step
    node_ready_s: list[float]  # per node
    health_s: list[float]
    rendezvous_s: list[float]  # per node, round 0
    log_bytes: list[int]  # per node
    cpu_s_per_node: dict[str, float]  # by role, summed over nodes / nodes
    restart_s: float | None = None  # fault job: kill -> first optimizer step after the restart
    restart_rendezvous_s: list[float] | None = None  # fault job: round 1, per node


def steps_so_far(run_dir: Path) -> dict[int, float]:
    """Node 0's telemetry rows while the job runs: none before the file exists."""
    return telemetry_step_times(run_dir) if (run_dir / "telemetry" / "node0.csv").exists() else {}


def rendezvous_rounds(log: str) -> dict[int, float]:
    return {int(round_): float(seconds) for round_, seconds in RENDEZVOUS.findall(log)}


def worker_of(launcher: subprocess.Popen[bytes]) -> psutil.Process:
    for process in psutil.Process(launcher.pid).children(recursive=True):
        if role_of(process.cmdline()) == "worker":
            return process
    raise RuntimeError("bench: the last node has no worker process to kill")


def run_job(nodes: int, work: Path, steps: int, kill_after: int | None, hosts: Sequence[Host] = ()) -> JobTimes:
    """One job of ``nodes`` launchers, on ``hosts`` when given."""
    name = f"n{nodes}-{'ns' if hosts else 'lo'}-{'fault' if kill_after else 'clean'}-{time.time_ns()}"
    log_dir, run_dir = work / "logs" / name, work / "runs" / name
    master = hosts[0].address if hosts else "127.0.0.1"
    port = 29400 if hosts else free_port()  # each namespace has its own ports
    overrides = [
        f"run.output_dir={work / 'runs'}",
        f"run.name={name}",
        f"trainer.max_steps={steps}",
        f"trainer.val_every_n_steps={steps}",
        "checkpoint.every_n_steps=10",
        "telemetry.every_n_steps=1",  # a row per step: the first step after a restart is on record
        "data.batch_size=8",
    ]
    env = bench_env(NPROC_PER_NODE="1", BACKEND="gloo", LOG_DIR=str(log_dir), RDZV_TIMEOUT="600", MAX_RESTARTS="1")
    launchers: list[subprocess.Popen[bytes]] = []
    killed_at = None
    with ProcessTreeCPU() as cpu, ExitStack() as stack:
        for rank in range(nodes):
            command = ["bash", str(REPO / "cluster_train.sh"), str(TINY_CONFIG), str(nodes), str(rank), master, str(port)]
            command += ["--", *overrides]
            if hosts:
                command = hosts[rank].command(*command)
            out = stack.enter_context((work / f"{name}-node{rank}.out").open("wb"))
            last_start = time.time()
            launchers.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT))
            cpu.watch(launchers[-1].pid)
        deadline = time.monotonic() + 900
        while any(p.poll() is None for p in launchers):
            if time.monotonic() > deadline:
                for p in launchers:
                    p.kill()
                raise SystemExit(f"bench: {name} still running after 900 s; see {work}")
            if kill_after and killed_at is None and any(step >= kill_after for step in steps_so_far(run_dir)):
                victim = worker_of(launchers[-1])
                killed_at = time.time()
                victim.send_signal(signal.SIGKILL)
            time.sleep(0.5)  # the bench shares the cores it measures: poll gently
    codes = [p.returncode for p in launchers]
    if codes != [0] * nodes:
        raise SystemExit(f"bench: {name}: launcher exit codes {codes}; logs in {log_dir}")
    logs = [(log_dir / f"latest_node{rank}.log").read_text() for rank in range(nodes)]
    rows = telemetry_step_times(run_dir)  # a restart rewrites the rows after its checkpoint
    first_step = rows[1]
    cpu_s = {role: seconds / nodes for role, seconds in cpu.by_role().items()}
    times = JobTimes(
        nodes=nodes,
        network="namespaces" if hosts else "loopback",
        first_step_s=first_step - last_start,
        node_ready_s=[float(NODE_READY.findall(log)[0]) for log in logs],
        health_s=[float(HEALTH.findall(log)[0]) for log in logs],
        rendezvous_s=[rendezvous_rounds(log)[0] for log in logs],
        log_bytes=[(log_dir / f"latest_node{rank}.log").resolve().stat().st_size for rank in range(nodes)],
        cpu_s_per_node=cpu_s,
    )
    if killed_at is not None:
        times.restart_s = min(t for t in rows.values() if t > killed_at) - killed_at
        times.restart_rendezvous_s = [rendezvous_rounds(log)[1] for log in logs]
    return times


def table(results: list[tuple[JobTimes, JobTimes]]) -> str:
    lines = [
        "| nodes | network | last start -> first step (s) | node ready (s, max) | health (s, max) | rendezvous (s, min / max)"
        " | log per node (KB) | CPU per node (s): launcher + agent + log writer / worker | restart after kill -9 (s)"
        " | restart rendezvous (s, max) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for clean, fault in results:
        cpu = clean.cpu_s_per_node
        helpers = cpu["launcher other"] + cpu["prepare"] + cpu["torchrun agent"] + cpu["log writer"]
        lines.append(
            f"| {clean.nodes} | {clean.network} | {clean.first_step_s:.1f} | {max(clean.node_ready_s):.1f}"
            f" | {max(clean.health_s):.2f} | {min(clean.rendezvous_s):.2f} / {max(clean.rendezvous_s):.2f}"
            f" | {statistics.mean(clean.log_bytes) / 1000:.1f} | {helpers:.1f} / {cpu['worker']:.1f}"
            f" | {fault.restart_s:.1f} | {max(fault.restart_rendezvous_s or [0]):.2f} |"
        )
    return "\n".join(lines)


def plot(results: list[tuple[JobTimes, JobTimes]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loopback = [(c, f) for c, f in results if c.network == "loopback"]
    nodes = [c.nodes for c, _ in loopback]
    figure, axis = plt.subplots(figsize=(7, 4.2))
    series = {
        "last start -> first step": [c.first_step_s for c, _ in loopback],
        "restart after kill -9": [f.restart_s or 0 for _, f in loopback],
        "node ready (max)": [max(c.node_ready_s) for c, _ in loopback],
        "rendezvous (min over nodes)": [min(c.rendezvous_s) for c, _ in loopback],
    }
    for label, values in series.items():
        axis.plot(nodes, values, marker="o", label=label)
    namespaces = [(c, f) for c, f in results if c.network == "namespaces"]
    for clean, fault in namespaces:
        axis.plot([clean.nodes], [clean.first_step_s], "k^", label=f"{clean.nodes} namespace hosts: first step")
        axis.plot([fault.nodes], [fault.restart_s or 0], "kv", label=f"{fault.nodes} namespace hosts: restart")
    axis.set_xscale("log", base=2)
    axis.set_xticks(nodes, [str(n) for n in nodes])
    axis.set_xlabel("nodes (one launcher and one worker each, all on one 2-core machine)")
    axis.set_ylabel("seconds")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--namespaces", type=int, default=0, help="also this many network-namespace hosts (root)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-after", type=int, default=15, help="fault job: kill the last node's worker after this step")
    parser.add_argument("--plot", type=Path, default=REPO / "bench" / "scale" / "node_scaling.png")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args()
    ensure_synthetic_set()
    results: list[tuple[JobTimes, JobTimes]] = []
    with tempfile.TemporaryDirectory(prefix="bench-nodes-") as tmp:
        work = Path(tmp)
        for nodes in args.nodes:
            results.append((run_job(nodes, work, args.steps, None), run_job(nodes, work, args.steps, args.kill_after)))
            print(f"{nodes} nodes: {results[-1][0]}\n  fault: restart {results[-1][1].restart_s:.1f} s", flush=True)
        if args.namespaces:
            with network_hosts(args.namespaces, subnet="10.231.8") as hosts:
                pair = (
                    run_job(args.namespaces, work, args.steps, None, hosts),
                    run_job(args.namespaces, work, args.steps, args.kill_after, hosts),
                )
            results.append(pair)
            print(f"{args.namespaces} namespace hosts: {pair[0]}\n  fault: restart {pair[1].restart_s:.1f} s", flush=True)
    print(f"\nmachine: {machine()}")
    print(f"{args.steps} steps per job; fault jobs kill the last node's worker after step {args.kill_after}\n")
    print(table(results))
    print(f"\nCPU seconds per node by part ({', '.join(ROLES)}):")
    for clean, _ in results:
        print(f"  {clean.nodes} {clean.network}: " + ", ".join(f"{v:.2f}" for v in clean.cpu_s_per_node.values()))
    plot(results, args.plot)
    print(f"plot: {args.plot}")
    if args.json:
        args.json.write_text(json.dumps([[asdict(c), asdict(f)] for c, f in results], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
