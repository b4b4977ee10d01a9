"""Prepared sets' shards: written by the dataset job (`train_phase2.py prepare`), read in training as a map-style dataset.

The folder's layout and manifest: data/prepared_manifest.py.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from purrsight.atomic_file import publishing
from purrsight.data.dataset import Sample
from purrsight.data.media import AudioDecoder, ImageDecoder


def shard_schema() -> Any:
    import pyarrow as pa

    return pa.schema(
        [
            ("id", pa.string()),
            ("line", pa.int32()),
            ("input_ids", pa.list_(pa.int32())),
            ("labels", pa.list_(pa.int32())),
            ("image", pa.binary()),  # the ImageDecoder's stored form (uint8 or float32), C-contiguous
            ("image_shape", pa.list_(pa.int32())),
            ("audio", pa.binary()),  # the clip at the encoder's rate, float32
            # The token index the media go before (data/text.py); null: in front. Absent from sets
            # prepared before placeholders were read: their media are in front.
            ("image_at", pa.int32()),
            ("audio_at", pa.int32()),
        ]
    )


def sample_row(
    sample_id: str,
    line: int,
    input_ids: list[int],
    labels: list[int],
    image: torch.Tensor | None,
    audio: np.ndarray | None,
    media_at: dict[str, int] | None = None,
) -> dict[str, Any]:
    media_at = media_at or {}
    return {
        "id": sample_id,
        "line": line,
        "input_ids": input_ids,
        "labels": labels,
        "image": None if image is None else image.contiguous().numpy().tobytes(),
        "image_shape": None if image is None else list(image.shape),
        "audio": None if audio is None else np.ascontiguousarray(audio, dtype=np.float32).tobytes(),
        "image_at": media_at.get("image"),
        "audio_at": media_at.get("audio"),
    }


def write_shard(path: Path, rows: Iterable[dict[str, Any]], batch_rows: int = 64) -> int:
    """Rows into one Arrow stream file (PreparedSplit memory-maps it with pyarrow); the number written."""
    import pyarrow as pa

    schema = shard_schema()
    count, pending = 0, []
    # Published whole and durable (atomic_file.py): the manifest, written after every shard, never
    # reaches the disk before a shard it names.
    with publishing(path) as sink, pa.ipc.new_stream(sink, schema) as writer:
        for row in rows:
            pending.append(row)
            if len(pending) == batch_rows:
                writer.write_batch(pa.RecordBatch.from_pylist(pending, schema=schema))
                count, pending = count + len(pending), []
        if pending:
            writer.write_batch(pa.RecordBatch.from_pylist(pending, schema=schema))
            count += len(pending)
    return count


class PreparedSplit(Dataset[Sample]):
    """One split of a prepared set as a map-style dataset of Samples.

    Shards are Arrow streams (``datasets.Dataset.from_file`` reads them too), memory-mapped
    here with pyarrow and read column by column: a sample costs tens of microseconds instead of
    the hundreds a generic row formatter takes. They are opened on first use, so a start costs a few
    file opens whatever the set's size, and loader workers open their own maps.
    """

    def __init__(self, folder: Path, shards: list[dict[str, Any]], image: ImageDecoder | None, audio: AudioDecoder | None) -> None:
        self.folder = folder
        self.files = [str(folder / f"{entry['name']}.arrow") for entry in shards]
        self.offsets = np.cumsum([0] + [int(entry["rows"]) for entry in shards]).tolist()
        self.image = image
        self.audio = audio
        self.image_dtype = torch.uint8 if image is None or image.storage == "uint8" else torch.float32
        self._open: dict[int, Any] = {}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = {}  # memory maps are per process: a loader worker opens its own
        return state

    def _shard(self, number: int) -> Any:
        table = self._open.get(number)
        if table is None:
            import pyarrow as pa

            # Views of the map, not copies: the record batches are left as they are (combining them
            # into one array would copy the whole shard into this process's memory).
            with pa.memory_map(self.files[number], "r") as source:
                table = pa.ipc.open_stream(source).read_all()
            table = self._open[number] = {name: table.column(name) for name in table.column_names}
        return table

    def lengths(self) -> list[int]:
        """Each sample's stored tokens, for data.group_by_length: the list offsets of ``input_ids``, read
        from the maps (a few bytes a sample; the token ids themselves are not touched)."""
        import pyarrow.compute as pc

        lengths: list[int] = []
        for number in range(len(self.files)):
            lengths.extend(pc.list_value_length(self._shard(number)["input_ids"]).to_pylist())
        return lengths

    def __getitem__(self, i: int) -> Sample:
        if not 0 <= i < len(self):
            raise IndexError(i)
        number = bisect.bisect_right(self.offsets, i) - 1
        columns, row = self._shard(number), i - self.offsets[number]
        image = audio = None
        picture, clip = columns["image"][row], columns["audio"][row]
        if self.image is not None and picture.is_valid:
            shape = columns["image_shape"][row].values.to_numpy().tolist()
            # A copy (the map is read-only), in the stored form the raw path's samples carry too.
            image = torch.frombuffer(bytearray(picture.as_buffer()), dtype=self.image_dtype).reshape(*shape)
        if self.audio is not None and clip.is_valid:
            audio = self.audio.features(np.frombuffer(clip.as_buffer(), dtype=np.float32))
        stored_at = {m: columns[f"{m}_at"][row].as_py() for m in ("image", "audio") if f"{m}_at" in columns}
        media_at = {m: at for m, at in stored_at.items() if at is not None}
        return Sample(
            columns["id"][row].as_py(),
            columns["input_ids"][row].values.to_numpy().tolist(),
            columns["labels"][row].values.to_numpy().tolist(),
            image,
            audio,
            skipped=0,
            media_at=media_at,
        )
