"""``python -m purrsight.ray_node COMMAND``: the steps batch/ray_cluster.sh runs (the package docstring lists them)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from purrsight.errors import ExitCode
from purrsight.ray_node import node
from purrsight.ray_node.address import node_address
from purrsight.ray_node.ports import BLOCK, JOB_SLOTS, PORT_BASE, free_block


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m purrsight.ray_node", description="A batch job's Ray on one node.")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check-config", help="validate the config before any Ray starts (exit 2 naming each problem)")
    check.add_argument("config")
    check.add_argument("overrides", nargs="*")
    address = commands.add_parser("address", help="print the address this node's Ray announces")
    address.add_argument("--hint", help="the scheduler's address or host name for this node")
    address.add_argument("--head", help="the head's address (workers: the route to it picks the interface)")
    ports = commands.add_parser("ports", help="print the job's port block, the next free one where a port of it is taken here")
    ports.add_argument("--job", required=True, help="the batch job's id: its block follows from it")
    ports.add_argument("--range-base", type=int, default=int(os.environ.get("RAY_PORT_BASE", PORT_BASE)))
    node.add_arguments(commands.add_parser("start", help="run this job's Ray on this node until the batch script's teardown"))
    waits = commands.add_parser("wait", help="wait for every node of the job, with a deadline")
    waits.add_argument("--ports", type=int, required=True, help="the job's port block (the head's dashboard is in it)")
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
    if args.command == "ports":
        block = free_block(args.job, args.range_base)
        if block is None:
            last = args.range_base + JOB_SLOTS * BLOCK - 1
            line = f"error: no block of {BLOCK} free ports in {args.range_base}-{last} on this host (RAY_PORT_BASE moves the range)"
            print(line, file=sys.stderr)
            return ExitCode.FAILED
        print(block.base)
        return 0
    if args.command == "start":
        return node.start(args)
    from purrsight.ray_node.wait import wait  # Ray's import: only the wait pays for it

    return wait(args)


if __name__ == "__main__":
    sys.exit(main())
