"""Process-group start-up under torchrun: node-ordered ranks, a fresh store, restart agreement.

Ranks. Node N's processes become global ranks N*nproc .. N*nproc+nproc-1.

torchrun's c10d rendezvous orders nodes by (address, pid), not by the node rank the user
typed, so node 0's processes are not always ranks 0..nproc-1, and rank 0 (which writes
checkpoints and the run report) may land on another machine. The launcher passes the
typed rank as PURRSIGHT_NODE_RANK; each worker renumbers itself (RANK, GROUP_RANK) before
Lightning reads them, and :func:`init_process_group_in_node_order` starts the process
group with a store hosted by torchrun's own rank 0, whose machine MASTER_ADDR names.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, MutableMapping
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar, cast

log = logging.getLogger(__name__)
T = TypeVar("T")
TORCHRUN_RANK = "PURRSIGHT_TORCHRUN_RANK"  # the rank torchrun assigned, kept for the store
ELASTIC_NODES = "PURRSIGHT_ELASTIC_NODES"  # MIN:MAX, exported by the launcher for an elastic job
ORDER_KEY = "purrsight/node_order/"  # + torchrun's rank: "node_rank local_rank", one key per process


def order_ranks_by_node(environ: MutableMapping[str, str]) -> str | None:
    """Renumber RANK/GROUP_RANK in ``environ``; returns a line for the log, or None if untouched.

    In an elastic job (PURRSIGHT_ELASTIC_NODES) a round's nodes may have gaps: node 1 of 0-2 lost
    leaves 0 and 2, and node_rank x processes would name rank 2 of a world of 2. There the ranks are
    ordered among the nodes present, through the store, when the process group starts
    (:func:`ranks_among_present_nodes`); here only torchrun's rank is kept for the store.
    """
    node_rank_text = environ.get("PURRSIGHT_NODE_RANK")
    if node_rank_text is None or "LOCAL_RANK" not in environ or "RANK" not in environ:
        return None
    node_rank = int(node_rank_text)
    local_rank = int(environ["LOCAL_RANK"])
    local_world = int(environ["LOCAL_WORLD_SIZE"])
    world = int(environ["WORLD_SIZE"])
    if environ.get(ELASTIC_NODES):
        environ.setdefault(TORCHRUN_RANK, environ["RANK"])
        return f"node_rank {node_rank} local_rank {local_rank}, elastic: ranks ordered among this round's nodes at the start"
    if world % local_world or node_rank >= world // local_world:
        return (
            f"ranks left as torchrun assigned them: node_rank {node_rank} does not fit {world} processes of {local_world} per node"
        )
    old = environ.setdefault(TORCHRUN_RANK, environ["RANK"])
    new = node_rank * local_world + local_rank
    environ["RANK"] = environ["ROLE_RANK"] = str(new)
    environ["GROUP_RANK"] = environ["ROLE_GROUP_RANK"] = str(node_rank)
    return f"node_rank {node_rank} local_rank {local_rank}: global rank {new} (torchrun assigned {old})"


def hosts_the_store(environ: MutableMapping[str, str]) -> bool:
    """Whether this worker's process hosts the job's TCPStore (torchrun's rank 0, unless the agent's store is shared)."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and environ.get(TORCHRUN_RANK) == "0"


def init_process_group_in_node_order(backend: str, timeout: timedelta) -> bool:
    """Start the default process group with node-ordered ranks; False when not under the launcher.

    The TCPStore is hosted by the process torchrun made rank 0: MASTER_ADDR:MASTER_PORT is
    on its machine. With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (set by the launcher, see
    pytorch/pytorch#135712: a store shared with the agent hangs restarted workers) that port
    is fresh every rendezvous round, so no stale keys of a killed round can be read.
    When the agent's store is shared instead, every worker is only its client.
    """
    import torch.distributed as dist

    if TORCHRUN_RANK not in os.environ or dist.is_initialized():
        return False
    world = int(os.environ["WORLD_SIZE"])
    if world <= 1:  # one process (the launcher on a laptop): nothing to order or agree on
        return False
    shared_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    hosts_store = hosts_the_store(os.environ)
    store: dist.Store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=hosts_store,
        timeout=timeout,
    )
    if shared_agent_store:  # the agent's store outlives rounds: isolate ours by restart count
        store = dist.PrefixStore(f"/purrsight/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    if os.environ.get(ELASTIC_NODES):
        line = ranks_among_present_nodes(store, os.environ)
        log.info(line)
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]), world_size=world, timeout=timeout)
    return True


def ranks_among_present_nodes(store: Any, environ: MutableMapping[str, str]) -> str:
    """Node-ordered RANK and GROUP_RANK among the nodes this round has, agreed through ``store``.

    Every process publishes its (node_rank, local_rank) under its torchrun rank and reads the
    others'; its rank is its place in their order, its group rank its node's place among the
    nodes present. The store is new each round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or the
    restart-count prefix), so no key of an earlier round is read.
    """
    world = int(environ["WORLD_SIZE"])
    mine = (int(environ["PURRSIGHT_NODE_RANK"]), int(environ["LOCAL_RANK"]))
    store.set(f"{ORDER_KEY}{environ[TORCHRUN_RANK]}", f"{mine[0]} {mine[1]}")
    keys = [f"{ORDER_KEY}{rank}" for rank in range(world)]
    store.wait(keys)
    placed = sorted(tuple(int(part) for part in store.get(key).decode().split()) for key in keys)
    if len(set(placed)) != world:  # every process sees the same list: all exit 2 together
        from purrsight.errors import UserError

        raise UserError(f"two nodes of this job were started with the same node_rank (node_rank, local_rank: {placed})")
    nodes = sorted({node for node, _ in placed})
    rank, group = placed.index(mine), nodes.index(mine[0])
    environ["RANK"] = environ["ROLE_RANK"] = str(rank)
    environ["GROUP_RANK"] = environ["ROLE_GROUP_RANK"] = str(group)
    return (
        f"elastic round of {len(nodes)} node(s) {nodes}: node_rank {mine[0]} local_rank {mine[1]} is global rank {rank} "
        f"(torchrun assigned {environ[TORCHRUN_RANK]})"
    )


def init_process_group(backend: str, timeout: timedelta) -> bool:
    """Start the default process group before Lightning does; False in a single process.

    Under the launcher the ranks are node-ordered (above). Under plain torchrun the group
    comes from torchrun's environment (env://). Either way it exists before training starts,
    so rank 0 can decide how the run starts and tell every rank (Lightning, which would
    otherwise start it later, sees it and skips its own).
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():  # another engine (Ray Train) started it, and chose the device
        return True
    if not init_process_group_in_node_order(backend, timeout):
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return False
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")):
            log.warning(
                "torchrun restarts with a rendezvous store shared by agent and workers hang (pytorch/pytorch#135712): "
                "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun, as cluster_train.sh does"
            )
        dist.init_process_group(backend, timeout=timeout)  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from torchrun
    if backend == "nccl":
        # Object collectives (the start decision) run on the current device: each rank's own
        # GPU, not cuda:0 for all, before Lightning would set it.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return True


def worker_generation(environ: MutableMapping[str, str]) -> int:
    """How many earlier worker generations this launch started on this node (0: the first).

    torchrun's TORCHELASTIC_RESTART_COUNT counts only this node's failures: when a worker
    dies on another node, the healthy node's agent restarts its workers for the new
    rendezvous round with the count unchanged, and those workers would start from scratch
    while the others resume. A node-local marker, keyed by the launch, counts every start.
    """
    restarts = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    launch = environ.get("PURRSIGHT_LAUNCH_ID")
    if launch is None:
        return restarts
    marker = Path(tempfile.gettempdir()) / f"purrsight-{launch}-local{environ.get('LOCAL_RANK', '0')}.starts"
    try:
        earlier = int(marker.read_text() or 0)
    except (OSError, ValueError):
        earlier = 0
    marker.write_text(str(earlier + 1))
    return max(restarts, earlier)


def _collective_device(backend: str) -> Any:
    import torch

    # The device init_process_group (or the engine that started the group) made current.
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def agreed_max(value: int, backend: str) -> int:
    """The largest ``value`` over all ranks (every rank must call)."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], device=_collective_device(backend))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def from_rank_zero(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (every rank must call)."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def computed_on_rank_zero(compute: Callable[[], T], group: Any = None) -> T:
    """``compute()`` run by rank 0 of ``group`` alone, its value on every rank of the group.

    What it raises is raised on every rank, so none waits in the broadcast for a value that never
    comes (an error that does not pickle arrives as a RuntimeError with its text). Every rank of
    ``group`` must call; with ``group`` None it is computed here, with no collective.
    """
    if group is None:
        return compute()
    import torch.distributed as dist

    outcome: tuple[Any, BaseException | None] = (None, None)
    if dist.get_rank(group) == 0:
        try:
            outcome = (compute(), None)
        except Exception as raised:
            outcome = (None, raised if pickles(raised) else RuntimeError(f"rank 0: {type(raised).__name__}: {raised}"))
    box = [outcome]
    dist.broadcast_object_list(box, group=group, group_src=0)
    value, error = box[0]
    if error is not None:
        raise error
    return cast(T, value)


def pickles(value: object) -> bool:
    import pickle

    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True
