"""The stop vote's side group (purrsight/distributed/stop_vote.py) waits no longer than the job's collectives."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from purrsight.distributed.stop_vote import vote_group


def group_timeout(group: Any) -> timedelta:
    """A gloo group's timeout (no public getter: read from its backend's options)."""
    return group._get_backend(torch.device("cpu")).options._timeout  # type: ignore[no-any-return]


def test_the_gloo_side_group_beside_nccl_takes_the_jobs_timeout(tmp_path: Path) -> None:
    """Under NCCL the vote runs in a gloo group of its own; torch's default for it is 30 minutes,
    which would hold a stop that a dead rank never answers far past distributed.timeout_s."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60))
    try:
        side = vote_group("nccl", timedelta(seconds=7))  # a new gloo group, as beside NCCL
        assert side is not dist.group.WORLD and group_timeout(side) == timedelta(seconds=7)
        assert vote_group("gloo", timedelta(seconds=7)) is dist.group.WORLD  # the default group, timed out at its start
        assert group_timeout(dist.group.WORLD) == timedelta(seconds=60)
    finally:
        dist.destroy_process_group()
