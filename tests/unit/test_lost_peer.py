"""A collective failed by a lost peer is said in one line (purrsight/distributed/lost_peer.py)."""

from __future__ import annotations

import pytest

from purrsight.distributed.lost_peer import raise_for_lost_peer
from purrsight.errors import PeerLostError

GLOO = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:13746. This is typically caused by a remote worker crashing."
)


@pytest.mark.parametrize(
    ("message", "named"),
    [
        (GLOO, "Connection closed by peer [127.0.0.1]:13746"),
        ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer", "Connection reset by peer"),
        ("NCCL error: remote process exited or there was a network error, NCCL version 2.27", "remote process exited"),
    ],
)
def test_a_transport_error_for_a_gone_peer_becomes_one_line_naming_it(message: str, named: str) -> None:
    with pytest.raises(PeerLostError) as raised:
        raise_for_lost_peer(RuntimeError(message))
    assert named in str(raised.value) and "\n" not in str(raised.value)
    assert "restart" in str(raised.value)


def test_any_other_error_is_left_to_its_traceback() -> None:
    raise_for_lost_peer(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))  # returns: the caller re-raises
    # NCCL says this after its own timeout too: a hang, the watchdog's to name, not a loss
    raise_for_lost_peer(RuntimeError("NCCL communicator was aborted on rank 3."))
