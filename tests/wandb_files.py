"""W&B's offline files read back record by record: what a tracker test checks against."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of one ``.wandb`` file (LevelDB's log format: 32 KiB blocks, records in pieces)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    block, position, pieces = 32768, 7, b""  # 7: the magic and the format version
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if length == 0 and kind == 0:
            position += left
            continue
        pieces += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or its last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def wandb_history(run_dir: Path) -> tuple[set[str], list[dict[str, float]]]:
    """(run ids, history rows) of every offline attempt in the run folder, as W&B keeps them when synced.

    Attempts are taken oldest first, and a row whose step is not above the run's highest is
    dropped, as W&B drops a step that goes back.
    """
    ids, rows = set(), []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "run":
                ids.add(record.run.run_id)
            elif record.WhichOneof("record_type") == "history":
                # W&B puts a key with a "/" in nested_key
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                row["_step"] = record.history.step.num
                if not rows or row["_step"] > rows[-1]["_step"]:
                    rows.append(row)
    return ids, rows
