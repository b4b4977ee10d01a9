"""A collective that failed because a peer process is gone: said in one line.

When a node dies (or a rank is killed), every other rank's next collective fails in the transport
with a traceback through Lightning and autograd that says nothing the transport's own message does
not. The message is what a user needs, with what happens next; the traceback stays for
LOG_LEVEL=DEBUG. A watchdog's firing (watchdog.raise_for_peer_firing) is checked first: a rank that
hung and was ended by its watchdog is a hang, not a loss.
"""

from __future__ import annotations

import re

from purrsight.errors import PeerLostError

# gloo's TCP transport ("Connection closed by peer [addr]:port", "Connection reset by peer"), and
# NCCL's words for a peer that went away. Not "NCCL communicator was aborted": NCCL says that after
# its own timeout too, which is a hang (the watchdog's), not a loss.
LOST_PEER = re.compile(
    r"Connection (?:closed|reset) by peer(?: \[[^\]]*\]:\d+)?"
    r"|remote process exited or there was a network error"
)


def raise_for_lost_peer(error: BaseException) -> None:
    """Raise PeerLostError naming the lost peer when ``error`` is a transport's word for one."""
    found = LOST_PEER.search(str(error))
    if found is not None:
        raise PeerLostError(
            f"a peer process is gone ({found.group(0)}): its node died or it was killed; torchrun's agents restart "
            "the workers from the last checkpoint (an elastic MIN:MAX job goes on without that node, unless it was "
            "node 0, which holds the rendezvous)"
        ) from error
