"""The wait for every node of a batch job's Ray cluster, with a deadline (``python -m purrsight.ray_node wait``).

Ends at once, naming the node, when a node's step ends before it joined (its Ray failed to
start), and names the missing nodes at the deadline; either way they join the job's bad-node
list, which the SLURM script excludes on requeue. A node whose step ended for a reason that is
no node's fault (a port another job took: the node records it in ``<log dir>/<node>.ended``)
is named in one line and not blamed. Ray is imported here only.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from purrsight.bad_nodes import name_bad_node
from purrsight.errors import ExitCode
from purrsight.parent_death import process_ended
from purrsight.ray_node.node import ENDED_SUFFIX
from purrsight.ray_node.ports import JobPorts
from purrsight.ray_node.say import Say


def alive_nodes(dashboard: str) -> dict[str, dict[str, float]]:
    """Node name -> total resources, for every node the head sees alive."""
    from ray.util.state import list_nodes

    nodes = list_nodes(address=dashboard, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)
    return {str(node.node_name): dict(node.resources_total or {}) for node in nodes}


def ended_because(log_dir: str, node: str) -> str:
    try:
        return (Path(log_dir) / f"{node}{ENDED_SUFFIX}").read_text()
    except OSError:
        return ""


def wait(args: argparse.Namespace) -> int:
    """Wait until every node is up with its GPUs, then print the job server's address; exit 3
    naming the missing node at the deadline, or at once when a node's step (``--watch NODE=PID``)
    has ended. A node named so joins the job's bad-node list (PURRSIGHT_BAD_NODES_FILE)."""
    say = Say("wait")
    expected = args.nodes.split(",")
    watched = dict(item.split("=", 1) for item in args.watch)
    dashboard = f"http://{args.head}:{JobPorts(args.ports).dashboard}"
    deadline = time.monotonic() + args.deadline
    last = ""
    while True:
        for node, pid in watched.items():
            if process_ended(int(pid)):
                reason, _, line = ended_because(args.log_dir, node).partition("\t")
                if reason == "ports":
                    say(f"error: node {node}'s Ray could not start: {line.strip()}")
                    return ExitCode.FAILED  # a requeue may find the ports free; no node to exclude
                say(f"error: node {node}'s Ray step ended before the cluster was up; its log: {args.log_dir}/{node}.log")
                name_bad_node(["ray start"], node=node)
                return ExitCode.CLUSTER
        try:
            alive = alive_nodes(dashboard)
        except Exception as err:  # the dashboard is still starting: ConnectionError, RayStateApiException
            alive, error = {}, f" (head: {type(err).__name__})"
        else:
            error = ""
        ready = [n for n in expected if n in alive and alive[n].get("GPU", 0) >= args.gpus_per_node]
        missing = [n for n in expected if n not in ready]
        if not missing:
            say(f"all {len(expected)} node(s) up: {', '.join(expected)}")
            print(dashboard)  # for the batch script: where to submit
            return 0
        status = f"{len(ready)}/{len(expected)} node(s) up; waiting for {', '.join(missing)}{error}"
        if status != last:
            say(status)
            last = status
        if time.monotonic() > deadline:
            without = [n for n in missing if n in alive]
            detail = f" ({', '.join(without)} joined without {args.gpus_per_node} GPUs)" if without else ""
            say(f"error: {', '.join(missing)} not up after {args.deadline:.0f} s{detail}; logs: {args.log_dir}/<node>.log")
            if len(missing) < len(expected):  # not when the head itself never answered: that is no worker's fault
                for node in missing:
                    name_bad_node(["ray start"], node=node)
            return ExitCode.CLUSTER
        time.sleep(1)
