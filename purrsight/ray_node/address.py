"""The address a node's Ray announces, chosen as the launcher chooses NCCL's interface."""

from __future__ import annotations

import os
import socket

from purrsight.launcher import network


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
    """NODE_ADDR wins; then the scheduler's own address of this node, when this machine holds it;
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
