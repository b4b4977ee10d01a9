"""Hosts with addresses of their own on one machine: network namespaces on a bridge.

Each host is a network namespace with one interface and an address ``<subnet>.<i+1>``; a
further namespace holds the bridge (the "switch") that joins them, so nothing is added to
the machine's own network. Launchers started with ``Host.run`` see only their host's
interface and loopback: the master's address must be routed, the launcher picks the
interface on that route, and gloo and the rendezvous store cross the bridge as they would
cross a switch. Needs root and iproute2 (CI runs as root).

Used by the network-cut and namespace-hosts tests and by bench/scale/node_scaling.py.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import count

_sets = count()


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()} (network namespaces need root and iproute2)")


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str
    link: str  # the host's interface, inside its namespace

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def set_link(self, up: bool) -> None:
        """Unplug (or plug back) this host's cable."""
        ip("-n", self.namespace, "link", "set", self.link, "up" if up else "down")


@contextmanager
def network_hosts(number: int, subnet: str = "10.231.7") -> Iterator[list[Host]]:
    """``number`` hosts on one bridge, ``subnet``.1 .. ``subnet``.N; removed on exit."""
    tag = f"{os.getpid() % 10000}{next(_sets) % 10}"  # interface names stay under 15 characters
    switch = f"psw{tag}"
    created = [switch]
    try:
        ip("netns", "add", switch)
        ip("-n", switch, "link", "add", "br0", "type", "bridge")
        ip("-n", switch, "link", "set", "br0", "up")
        hosts = []
        for index in range(number):
            host = Host(f"ph{index}-{tag}", f"{subnet}.{index + 1}", f"ph{index}e{tag}")
            port = f"ps{index}e{tag}"
            ip("netns", "add", host.namespace)
            created.append(host.namespace)
            ip("link", "add", host.link, "type", "veth", "peer", "name", port)
            ip("link", "set", host.link, "netns", host.namespace)
            ip("link", "set", port, "netns", switch)
            ip("-n", switch, "link", "set", port, "master", "br0")
            ip("-n", switch, "link", "set", port, "up")
            ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.link)
            ip("-n", host.namespace, "link", "set", host.link, "up")
            ip("-n", host.namespace, "link", "set", "lo", "up")
            hosts.append(host)
        yield hosts
    finally:
        for namespace in created:  # deleting a namespace deletes its interfaces and their peers
            subprocess.run(["ip", "netns", "delete", namespace], capture_output=True)
