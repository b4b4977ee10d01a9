"""What a data position is counted in: the order of the training set's samples, and what decides it.

A checkpoint's position (data_position.py) says "epoch E, S samples of it trained". That only
means the same samples again if the epoch's order is the same: the same set (its size and its
content), the same seed, the same length grouping. A checkpoint records them beside the position;
a resume compares them, and where one differs it refuses, naming each difference, unless the
user asked (``data.on_data_change: next_epoch``) to start the next epoch at sample 0 on the
set as it is now. World size and batch shape are not among them: positions count samples of the
job's one global order, the same on any world size (data/sampler.py).

The content (digested by training/datamodule.py, which knows the data): a prepared set's manifest
(it names every shard and its source's digest), or the index's own bytes (a pattern of shards by
their names, sizes and edges, data/formats/sources.py).
"""

from __future__ import annotations

from typing import Any

from purrsight.config import Config
from purrsight.errors import UserError

ORDER_KEY = "data_order"  # inside the checkpoint's "purrsight" section, beside the position
SHOWN_DIGEST = 12  # hex digits of a content digest shown in a message


class DataChangedError(UserError):
    """A resume onto a training set, seed or grouping other than the checkpoint's."""


def order_of(config: Config, samples: int, content: str, grouping: int) -> dict[str, Any]:
    """What decides the training order of ``samples`` samples of content ``content`` under ``config``,
    ``grouping`` the version of the length grouping that orders it (data/sampler.py, GROUPING_VERSION)."""
    data = config.data
    order: dict[str, Any] = {
        "samples": samples,
        "content": content,
        "seed": config.run.seed,
        "group_by_length": data.group_by_length,
    }
    if data.group_by_length:  # the groups' shape matters only when grouping is on
        order |= {
            "length_group_size": data.length_group_size,
            "length_group_window": data.length_group_window,
            "grouping": grouping,
        }
    return order


def _shown(key: str, value: Any) -> str:
    if key == "content" and isinstance(value, str):
        kind, _, digest = value.partition(":")
        return f"{kind} {digest[:SHOWN_DIGEST]}"
    return str(value)


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Each setting of the order that differs, as "name: then -> now"."""
    names = {"samples": "training samples", "content": "content", "seed": "run.seed", "group_by_length": "data.group_by_length"}
    names["grouping"] = "the length grouping's version (data/sampler.py, GROUPING_VERSION)"
    keys = list(names)[:4]
    if saved.get("group_by_length") and now.get("group_by_length"):
        keys += ["length_group_size", "length_group_window", "grouping"]
        saved = {"grouping": 1, **saved}  # recorded since version 2; the records before it were made by version 1
    return [
        f"{names.get(key, 'data.' + key)}: {_shown(key, saved.get(key))} -> {_shown(key, now.get(key))}"
        for key in keys
        if saved.get(key) != now.get(key)
    ]


def only_the_grouping_version(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether the grouping's version is all that differs (a checkpoint from before version 2)."""
    return bool(saved.get("group_by_length")) and differences({**saved, "grouping": now.get("grouping")}, now) == []
