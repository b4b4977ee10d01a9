"""Which interface and address reach the master, whether its port answers, and what InfiniBand this node has.

Both are read from the system (``ip route get``, ``/sys/class/infiniband``) by thin
functions, and decided by pure ones that take the text or the tree as arguments, so the
decisions are tested with fake routes and fake sysfs trees.
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SYS_INFINIBAND = Path("/sys/class/infiniband")


@dataclass(frozen=True)
class Route:
    interface: str
    source: str | None  # this node's address on that interface


@dataclass(frozen=True)
class IBPort:
    device: str
    port: int
    link_layer: str  # "InfiniBand", or "Ethernet" for RoCE
    gid_index: int | None  # RoCE v2 IPv4 GID (NCCL_IB_GID_INDEX); None on native IB


def resolve(host: str) -> str:
    """The IPv4/IPv6 address of ``host``; raises OSError when it does not resolve."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])


def await_port(
    addr: str, port: int, timeout_s: float, interval_s: float = 1.0, waiting: Callable[[OSError], None] | None = None
) -> int:
    """Retry a TCP connect until ``addr:port`` answers; the attempts it took.

    A node started before the one it joins waits here instead of failing at once; ``waiting``
    hears the first refusal. Past ``timeout_s`` the last attempt's OSError is raised.
    """
    deadline = time.monotonic() + timeout_s
    attempts = 0
    while True:
        attempts += 1
        try:
            with socket.create_connection((addr, port), timeout=min(5.0, max(0.1, deadline - time.monotonic()))):
                return attempts
        except OSError as err:
            if time.monotonic() + interval_s > deadline:
                raise
            if attempts == 1 and waiting is not None:
                waiting(err)
            time.sleep(interval_s)


def parse_route(text: str) -> Route | None:
    """Parse ``ip -o route get ADDR``: '10.0.0.1 dev ib0 src 10.0.0.2 uid 0 \\ cache'."""
    words = text.split()
    interface = words[words.index("dev") + 1] if "dev" in words else None
    source = words[words.index("src") + 1] if "src" in words else None
    return Route(interface, source) if interface else None


def parse_address_owner(text: str) -> str | None:
    """Parse ``ip -o addr show to ADDR``: '2: ib0    inet 10.0.0.1/24 brd ...' -> 'ib0'."""
    words = text.split()
    return words[1].rstrip(":") if len(words) > 1 else None


def _ip(*args: str) -> str | None:
    try:
        out = subprocess.run(["ip", "-o", *args], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def route_to(address: str) -> Route | None:
    """The route this node takes to ``address`` (None when `ip` is missing or fails).

    On the master itself the kernel answers 'local ADDR dev lo': the other nodes do not
    reach it over lo, so the interface that holds the address is the one to use.
    """
    text = _ip("route", "get", address)
    route = parse_route(text) if text else None
    if route is not None and route.interface == "lo" and not ipaddress.ip_address(address).is_loopback:
        owner = parse_address_owner(_ip("addr", "show", "to", address) or "")
        if owner:
            return Route(owner, address)
    return route


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _roce_v2_ipv4_gid(port_dir: Path) -> int | None:
    """Index of the first RoCE v2 GID that maps an IPv4 address (what NCCL wants on RoCE)."""
    types = port_dir / "gid_attrs" / "types"
    if not types.is_dir():
        return None
    for entry in sorted(types.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 1 << 30):
        if not entry.name.isdigit() or "v2" not in _read(entry).lower():
            continue
        gid = _read(port_dir / "gids" / entry.name)
        if gid.startswith("0000:0000:0000:0000:0000:ffff:"):
            return int(entry.name)
    return None


def active_ib_ports(root: Path = SYS_INFINIBAND) -> list[IBPort]:
    """Ports whose state is ACTIVE under an InfiniBand sysfs tree."""
    ports: list[IBPort] = []
    if not root.is_dir():
        return ports
    for device in sorted(root.iterdir()):
        for port_dir in sorted((device / "ports").glob("*")):
            if "ACTIVE" not in _read(port_dir / "state"):
                continue
            link_layer = _read(port_dir / "link_layer") or "InfiniBand"
            gid = _roce_v2_ipv4_gid(port_dir) if link_layer == "Ethernet" else None
            ports.append(IBPort(device.name, int(port_dir.name), link_layer, gid))
    return ports
