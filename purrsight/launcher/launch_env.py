"""The environment a node exports before torchrun: decided here, exported by cluster_train.sh.

A variable the user already exported is never overridden (NCCL_* included); the plan
says which were set and which were kept, and the launcher prints it as one block. The
launcher's prepare step (purrsight/launcher/node_plan.py) writes the plan into the file it
hands the launcher.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass

from purrsight.launcher.network import IBPort, Route

SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD")
NCCL_PRESETS = ("auto", "ib", "ethernet", "none")


@dataclass(frozen=True)
class EnvVar:
    name: str
    value: str
    kept: bool  # True: the user's own value, left as it was
    reason: str


def mask(name: str, value: str) -> str:
    """Hide values of variables that look like credentials before they reach a log."""
    return "****" if any(marker in name.upper() for marker in SECRET_MARKERS) else value


def nccl_settings(preset: str, ports: list[IBPort], route: Route | None, debug: bool) -> list[tuple[str, str, str]]:
    """(name, value, reason) for NCCL, from the preset, the active IB ports and the route to the master."""
    settings: list[tuple[str, str, str]] = []
    if preset == "none":
        return settings
    use_ib = preset == "ib" or (preset == "auto" and bool(ports))
    if use_ib:
        settings.append(("NCCL_IB_DISABLE", "0", f"{len(ports)} active InfiniBand/RoCE port(s)" if ports else "NCCL_PRESET=ib"))
        if ports:
            hcas = ",".join(f"{p.device}:{p.port}" for p in ports)
            settings.append(("NCCL_IB_HCA", hcas, "the active ports"))
            gids = {p.gid_index for p in ports if p.gid_index is not None}
            if len(gids) == 1:
                settings.append(("NCCL_IB_GID_INDEX", str(gids.pop()), "RoCE v2 IPv4 GID"))
    else:
        why = "NCCL_PRESET=ethernet" if preset == "ethernet" else "no active InfiniBand port"
        settings.append(("NCCL_IB_DISABLE", "1", why))
    if route is not None and route.interface != "lo":
        # The interface that routes to the master, not the first one NCCL finds: nodes with
        # docker0 or a management NIC otherwise try to talk over the wrong network.
        settings.append(("NCCL_SOCKET_IFNAME", route.interface, "interface that routes to the master"))
    settings.append(("NCCL_DEBUG", "INFO" if debug else "WARN", "from LOG_LEVEL"))
    return settings


def threads_per_process(
    cpu_count: int, nproc: int, num_nodes: int, master_addr: str, source: str = "cores"
) -> tuple[str, str, str]:
    """OMP_NUM_THREADS: the CPUs this node's share of the job may use, shared by its processes.

    A master on a loopback address is reachable from this machine only, so every node of
    the job runs here (nodes tried out on one laptop, or tests): their processes share the
    cores. Each launcher giving its processes all the cores would oversubscribe them once per node.
    """
    try:
        local_nodes = num_nodes if ipaddress.ip_address(master_addr).is_loopback else 1
    except ValueError:
        local_nodes = 1
    processes = max(1, nproc) * max(1, local_nodes)
    reason = f"{cpu_count} CPUs ({source}) / {nproc} processes"
    if local_nodes > 1:
        reason += f" x {local_nodes} nodes, all on this machine (loopback master)"
    return ("OMP_NUM_THREADS", str(max(1, cpu_count // processes)), reason)


def plan(
    environ: Mapping[str, str],
    master_addr: str,
    master_port: int,
    nproc: int,
    backend: str,
    log_level: str,
    preset: str,
    ports: list[IBPort],
    route: Route | None,
    cpu_count: int,
    num_nodes: int = 1,
    cpu_source: str = "cores",
) -> list[EnvVar]:
    debug = log_level.upper() == "DEBUG"
    wanted: list[tuple[str, str, str]] = [
        ("MASTER_ADDR", master_addr, "rendezvous host"),
        ("MASTER_PORT", str(master_port), "rendezvous port"),
        threads_per_process(cpu_count, nproc, num_nodes, master_addr, cpu_source),
        # 3 = tear down on a collective error and keep the flight recorder's dump;
        # torchrun itself would set 1 when unset.
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3", "fail fast on a broken collective"),
        ("PYTHONFAULTHANDLER", "1", "stack traces on a hard crash"),
        ("PYTHONUNBUFFERED", "1", "log lines arrive as they are written"),
        # A store shared between torchrun's agent and the workers is keyed per restart count,
        # which nodes do not agree on after a re-rendezvous: restarted workers then hang in
        # init (pytorch/pytorch#135712). A fresh store per round avoids it.
        ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1", "restarted workers must not share the agent's store"),
    ]
    if backend == "gloo" and route is not None:
        wanted.append(("GLOO_SOCKET_IFNAME", route.interface, "interface that routes to the master"))
    if debug:
        wanted.append(("TORCH_DISTRIBUTED_DEBUG", "DETAIL", "LOG_LEVEL=DEBUG"))
    if backend == "nccl":
        wanted += nccl_settings(preset, ports, route, debug)
    return [
        EnvVar(name, environ[name], True, "exported by the user") if name in environ else EnvVar(name, value, False, reason)
        for name, value, reason in wanted
    ]


def dump_environment(environ: Mapping[str, str]) -> list[str]:
    """NAME=value lines of the whole environment, sorted, credentials masked."""
    return [f"{name}={mask(name, value)}" for name, value in sorted(environ.items())]
