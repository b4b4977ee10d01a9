"""The node plan: the launcher's one Python step before torchrun, everything a node must know or check first.

cluster_train.sh validates its arguments, activates the Python environment and then runs

    python -m purrsight.launcher.node_plan --plan FILE --transcript FILE [options] CONFIG [-- overrides]

which, in one process and with the config parsed once:

1. probes the node (python, torch, CUDA, NCCL, visible GPUs; torch is not imported where no
   GPU driver is loaded);
2. validates the config and decides the placement (purrsight/placement.py: GPU or CPU, NCCL
   or gloo) and the number of processes;
3. refuses a start into a run folder that holds another run (not with --dry-run);
4. plans the environment to export (purrsight/launcher/launch_env.py);
5. writes the plan as a bash file for the launcher to ``source``;
6. runs the health checks (purrsight/launcher/health.py; not with --dry-run or --no-health).

Lines a user reads go to stdout and into the transcript, which the launcher copies into the
node log once it starts; errors go to stderr. Exit codes: 0, 2 for a user mistake (one line
names it), 3 when a health check failed (the plan is written before the checks run). A
Python without torch (or without purrsight) fails with ModuleNotFoundError before any plan:
the launcher names that Python and the command that installs both into it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from purrsight.atomic_file import write_text_atomically
from purrsight.errors import ExitCode
from purrsight.launcher import health, launch_env, network, probe
from purrsight.launcher.cpus import usable_cpus

HELP_HINT = "Try './cluster_train.sh --help'."


class LauncherError(Exception):
    """A user mistake the launcher reports as one line (plus the --help hint when ``usage``)."""

    def __init__(self, message: str, usage: bool = True, before: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.usage = usage
        self.before = list(before)  # lines printed first (a config's problems, one each)


@dataclass
class Plan:
    """What the launcher sources: its variables, the exports, and the lines it shows."""

    variables: dict[str, str] = field(default_factory=dict)
    exports: dict[str, str] = field(default_factory=dict)
    banner: list[str] = field(default_factory=list)  # EXPORTED: one line per variable, set or kept
    dry_run: list[str] = field(default_factory=list)  # DRY_LINES: shell lines a user could paste
    environment_dump: list[str] = field(default_factory=list)  # LOG_LEVEL=DEBUG only

    def export(self, name: str, value: str, reason: str) -> None:
        self.exports[name] = value
        self.banner.append(f"set   {name}={value}  ({reason})")
        self.dry_run.append(f"export {name}={shlex.quote(value)}  # {reason}")

    def keep(self, name: str, value: str, reason: str) -> None:
        self.banner.append(f"kept  {name}={value}  ({reason})")
        self.dry_run.append(f"# kept {name}={shlex.quote(value)}  ({reason})")

    def bash(self) -> str:
        lines = ["# written by purrsight.launcher.node_plan for cluster_train.sh to source"]
        lines += [f"{name}={shlex.quote(value)}" for name, value in self.variables.items()]
        lines += [f"export {name}={shlex.quote(value)}" for name, value in self.exports.items()]
        for array, items in (("EXPORTED", self.banner), ("DRY_LINES", self.dry_run), ("ENVIRONMENT_DUMP", self.environment_dump)):
            lines.append(f"{array}=(" + " ".join(shlex.quote(item) for item in items) + ")")
        return "\n".join(lines) + "\n"


def processes(nproc_per_node: str, accelerator: str, gpus: int) -> int:
    nproc = (gpus if accelerator == "gpu" else 1) if nproc_per_node == "auto" else int(nproc_per_node)
    if accelerator == "gpu" and nproc > gpus:
        raise LauncherError(
            f"NPROC_PER_NODE={nproc} but only {gpus} GPU(s) are visible (one process per GPU; BACKEND=gloo runs on CPU)"
        )
    return nproc


def check_run_folder(run_dir: Path, if_exists: str, resume: bool) -> None:
    from purrsight.run_folder import RunFolderError, refuse_mixing

    if resume:
        return
    try:
        refuse_mixing(run_dir, if_exists)
    except RunFolderError as err:
        raise LauncherError(f"error: {err}", usage=False) from None


def plan_environment(plan: Plan, args: argparse.Namespace, nproc: int, backend: str) -> str:
    """Fill ``plan`` with the node's exports; returns this node's address on the route to the master."""
    route = network.route_to(args.master_addr)
    cpus, cpu_source = usable_cpus(os.environ)
    entries = launch_env.plan(
        os.environ,
        args.master_addr,
        args.master_port,
        nproc,
        backend,
        args.log_level,
        args.nccl_preset,
        network.active_ib_ports(),
        route,
        cpus,
        args.num_nodes,
        cpu_source,
    )
    for entry in entries:
        (plan.keep if entry.kept else plan.export)(entry.name, entry.value, entry.reason)
    return os.environ.get("NODE_ADDR") or (route.source if route and route.source else args.master_addr)


def plan_node(args: argparse.Namespace, say: Say) -> tuple[Plan, int]:
    """The plan, written; then the health checks. Returns the plan and the exit code."""
    node = probe.probe()  # no torch: ModuleNotFoundError, which the launcher turns into its install line
    from purrsight.config import ConfigError, load_config
    from purrsight.placement import PlacementError, decide

    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as err:
        raise LauncherError(
            f"config {args.config} is invalid (see above)", before=[f"config error: {line}" for line in err.problems]
        ) from None
    backend = args.backend if args.backend != "auto" else config.distributed.backend
    try:
        placement = decide(config.trainer.accelerator, backend, node.gpus)
    except PlacementError as err:
        raise LauncherError(str(err)) from None
    nproc = processes(args.nproc_per_node, placement.accelerator, node.gpus)
    if config.distributed.strategy == "fsdp" and nproc * args.num_nodes == 1:
        raise LauncherError(
            "distributed.strategy=fsdp shards the frozen weights over several processes and this job has one "
            "(NPROC_PER_NODE=1, NUM_NODES=1); start 2 or more or set distributed.strategy=ddp"
        )
    if not args.dry_run:
        check_run_folder(config.run.run_dir, config.run.if_exists, resume=bool(args.resume))

    plan = Plan()
    plan.variables.update({f"NODE_{key.upper()}": str(value) for key, value in asdict(node).items()})
    plan.variables.update(ACCELERATOR=placement.accelerator, BACKEND=placement.backend, NPROC=str(nproc))
    plan.exports.update(placement.environment())
    plan.dry_run.append(
        f"export PURRSIGHT_ACCELERATOR={placement.accelerator} PURRSIGHT_BACKEND={placement.backend}"
        "  # the workers take this placement as it is"
    )
    local_addr = plan_environment(plan, args, nproc, placement.backend)
    plan.variables["LOCAL_ADDR"] = local_addr
    plan.exports["PURRSIGHT_NODE_ADDR"] = local_addr  # the watchdog names unreachable nodes by it
    if args.log_level == "DEBUG":
        planned = {**os.environ, **plan.exports}
        plan.environment_dump = launch_env.dump_environment(planned)
    write_plan(args.plan, plan)

    if args.dry_run or not args.health:
        return plan, ExitCode.OK
    started = time.monotonic()
    failed = health.run_checks(
        config,
        args.node_rank,
        args.master_addr,
        args.master_port,
        args.log_dir,
        placement.backend,
        node.gpus,
        args.min_free_gb,
        args.master_timeout,
        say,
    )
    say(launcher_line(f"health checks took {time.monotonic() - started:.2f} s"))  # bench/scale/node_scaling.py reads it
    return plan, ExitCode.CLUSTER if failed else ExitCode.OK


def write_plan(path: Path, plan: Plan) -> None:
    write_text_atomically(path, plan.bash())  # the launcher sources a whole plan or none


class Say:
    """Prints a line for the user and keeps it for the node log (the launcher copies it there)."""

    def __init__(self, transcript: IO[str] | None) -> None:
        self.transcript = transcript

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        if self.transcript is not None:
            self.transcript.write(line + "\n")
            self.transcript.flush()


def launcher_line(message: str) -> str:
    """``message`` stamped as cluster_train.sh's own lines are (its ``log`` and ``die_usage``)."""
    return f"{time.strftime('%Y-%m-%d %H:%M:%S')} [cluster_train] {message}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m purrsight.launcher.node_plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    parser.add_argument("--plan", type=Path, required=True, help="the bash file to write for the launcher to source")
    parser.add_argument("--transcript", type=Path, help="also append the lines shown to this file")
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--master-addr", default="127.0.0.1", help="the master's IP address (resolved by the launcher)")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    parser.add_argument("--nproc-per-node", default="auto")
    parser.add_argument("--nccl-preset", choices=launch_env.NCCL_PRESETS, default="auto")
    parser.add_argument("--log-level", choices=("INFO", "DEBUG"), default="INFO")
    parser.add_argument("--log-dir", type=Path, default=Path("logs/distributed_training"))
    parser.add_argument("--resume", default="", help="RESUME: auto continues the run in the run folder")
    parser.add_argument("--no-health", dest="health", action="store_false", help="skip the health checks (HEALTH_CHECKS=0)")
    parser.add_argument("--min-free-gb", type=float, default=1.0, help="HEALTH_MIN_FREE_GB")
    parser.add_argument("--master-timeout", type=float, default=900.0, help="seconds a worker node waits for the master")
    parser.add_argument("--dry-run", action="store_true", help="plan only: no run-folder check, no health checks")
    return parser.parse_intermixed_args(argv)  # overrides may follow the options


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with open(args.transcript, "a") if args.transcript else contextlib.nullcontext() as transcript:
        try:
            return plan_node(args, Say(transcript))[1]
        except LauncherError as err:
            lines = [*err.before, launcher_line(f"error: {err}" if err.usage else str(err))]
            if err.usage:
                lines.append(HELP_HINT)
            print("\n".join(lines), file=sys.stderr, flush=True)
            return ExitCode.USAGE


if __name__ == "__main__":
    raise SystemExit(main())
