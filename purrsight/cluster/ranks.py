"""Make node N's processes global ranks N*nproc .. N*nproc+nproc-1.

torchrun's c10d rendezvous orders nodes by (address, pid), not by the node rank the
user typed, so node 0's processes are not always ranks 0..nproc-1, and rank 0 (which
writes checkpoints and the run report) may land on another machine. The launcher passes
the typed rank as PURRSIGHT_NODE_RANK and each worker renumbers itself before the
process group starts. That is safe only when the workers' store is the torchrun agent's
(TORCHELASTIC_USE_AGENT_STORE=True, the c10d default): no worker hosts a store server, so
any consistent permutation of ranks works.
"""

from __future__ import annotations

from collections.abc import MutableMapping


def order_ranks_by_node(environ: MutableMapping[str, str]) -> str | None:
    """Renumber RANK/GROUP_RANK in ``environ``; returns a line for the log, or None if untouched."""
    node_rank_text = environ.get("PURRSIGHT_NODE_RANK")
    if node_rank_text is None or "LOCAL_RANK" not in environ or "RANK" not in environ:
        return None
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return "ranks left as torchrun assigned them: workers do not use the agent's store"
    node_rank = int(node_rank_text)
    local_rank = int(environ["LOCAL_RANK"])
    local_world = int(environ["LOCAL_WORLD_SIZE"])
    world = int(environ["WORLD_SIZE"])
    if world % local_world or node_rank >= world // local_world:
        return (
            f"ranks left as torchrun assigned them: node_rank {node_rank} does not fit {world} processes of {local_world} per node"
        )
    old = environ["RANK"]
    new = node_rank * local_world + local_rank
    environ["RANK"] = environ["ROLE_RANK"] = str(new)
    environ["GROUP_RANK"] = environ["ROLE_GROUP_RANK"] = str(node_rank)
    return f"node_rank {node_rank} local_rank {local_rank}: global rank {new} (torchrun assigned {old})"
