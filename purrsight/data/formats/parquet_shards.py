"""Parquet shards with the media inside (the Hugging Face Hub's layout), read row group by row group.

Columns, by data.fields: ``image`` / ``audio`` as ``{bytes, path}`` structs (the ``datasets``
Image and Audio features), raw bytes, a path string (relative to data.media_root, else the
shard's folder), decoded audio (``{array, sampling_rate}``, the Audio feature decoded: read as WAV)
or a list of those; a media column data.fields does not name is refused by name; the text as a column of turns (``conversations`` /
``messages``), ``prompt`` and ``response``, or a caption (``caption`` / ``text``: the response to
data.caption_prompt); ``id`` when there is one (else ``SHARD:ROW``). Rows are read 64 at a time
from one row group at a time (pyarrow), so a 900 MB shard is never in memory whole; a prepare
worker starts at its first row's row group.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from purrsight.data.formats.conversations import _turns
from purrsight.data.formats.records import ASSISTANT, USER, FieldNames, Media, MediaBlob, Record, RecordError, conversation_record

BATCH_ROWS = 64


def _media_kind(column: Any) -> str | None:
    """What a column's Arrow type holds when it surely holds media: the ``datasets`` Image/Audio
    features' ``{bytes, path}`` structs, or decoded audio (``{array, sampling_rate}``), else None.
    Lists of them alike. (A plain binary column may be media or a digest: not counted.)"""
    import pyarrow as pa

    kind = column.type
    while pa.types.is_list(kind) or pa.types.is_large_list(kind):
        kind = kind.value_type
    if pa.types.is_struct(kind):
        children = {kind.field(i).name for i in range(kind.num_fields)}
        if {"array", "sampling_rate"} <= children:
            return "decoded audio"
        if {"bytes", "path"} <= children:
            return "{bytes, path} structs"
    return None


def _unnamed_media(path: Path, schema: Any, chosen: dict[str, str | None], fields: FieldNames) -> str | None:
    """Media in a column data.fields does not name, in a file where no media column was found: without
    this line the set prepared as text only, and the prepare said "complete, 0 left out"."""
    if chosen["image"] or chosen["audio"]:
        return None  # media read from the columns named; a second one is the user's choice
    named = {*fields.image, *fields.audio, *fields.caption, *fields.conversations, fields.prompt, fields.response, fields.id}
    for column in schema:
        if column.name not in named and _media_kind(column) is not None:
            return (
                f"{path}: column {column.name!r} holds media ({_media_kind(column)}) that data.fields does not name "
                f"(image: {', '.join(fields.image)}; audio: {', '.join(fields.audio)}): add it, as "
                f"data.fields.image=[{column.name}] or data.fields.audio=[{column.name}], or drop the column"
            )
    return None


def _columns(path: Path, names: list[str], fields: FieldNames) -> dict[str, str | None]:
    def first(candidates: tuple[str, ...]) -> str | None:
        return next((name for name in candidates if name in names), None)

    chosen = {
        "turns": first(fields.conversations),
        "prompt": fields.prompt if fields.prompt in names and fields.response in names else None,
        "caption": first(fields.caption),
        "image": first(fields.image),
        "audio": first(fields.audio),
        "id": fields.id if fields.id in names else None,
    }
    if not (chosen["turns"] or chosen["prompt"] or chosen["caption"]):
        looked = [*fields.conversations, f"{fields.prompt}+{fields.response}", *fields.caption]
        raise RecordError(
            f"{path}: no text column (looked for {', '.join(looked)}; the file has {', '.join(names)}); name yours in data.fields"
        )
    return chosen


def _media(cell: Any, where: str, folder: Path) -> list[Media]:
    cells = cell if isinstance(cell, list) else [] if cell is None else [cell]
    found: list[Media] = []
    for item in cells:
        if isinstance(item, dict) and item.get("array") is not None and item.get("sampling_rate"):
            found.append(MediaBlob(_wav(item["array"], int(item["sampling_rate"])), f"{where}:{item.get('path') or 'array'}"))
        elif isinstance(item, dict):  # {bytes, path}: bytes when embedded, else a path
            if item.get("bytes"):
                found.append(MediaBlob(item["bytes"], f"{where}:{item.get('path') or 'bytes'}"))
            elif item.get("path"):
                found.append(folder / item["path"])
        elif isinstance(item, bytes):
            found.append(MediaBlob(item, f"{where}:bytes"))
        elif isinstance(item, str) and item:
            found.append(folder / item)
    return found


def _wav(samples: Any, rate: int) -> bytes:
    """Decoded audio (the ``datasets`` Audio feature's ``{array, sampling_rate}``) as WAV bytes, which
    the audio decoder reads as it reads a file (float samples kept as float)."""
    import io

    import numpy as np
    import soundfile

    wave = np.asarray(samples, dtype=np.float32)
    if wave.ndim == 2 and wave.shape[0] < wave.shape[1]:
        wave = wave.T  # datasets' mono=False gives (channels, samples); soundfile takes (samples, channels)
    buffer = io.BytesIO()
    soundfile.write(buffer, wave, rate, format="WAV", subtype="FLOAT")
    return buffer.getvalue()


def row_count(path: Path) -> int:
    import pyarrow.parquet as pq

    return int(pq.ParquetFile(path).metadata.num_rows)


def parquet_records(
    path: Path, row: int, fields: FieldNames, caption_prompt: str, media_root: Path, load_media: bool = True
) -> Iterator[tuple[int, Record | RecordError]]:
    """(row index, Record) for each row from ``row`` on."""
    import pyarrow.parquet as pq

    try:
        shard = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises its own ArrowInvalid, OSError, ...: one line naming the file
        raise RecordError(f"{path}: not a readable Parquet file ({err})") from None
    chosen = _columns(path, shard.schema_arrow.names, fields)
    unnamed = _unnamed_media(path, shard.schema_arrow, chosen, fields)
    if unnamed is not None:
        raise RecordError(unnamed)
    wanted = [name for key, name in chosen.items() if name and (load_media or key not in ("image", "audio"))]
    if chosen["prompt"]:
        wanted.append(fields.response)
    groups, first_row, group_start = [], 0, 0  # the row groups from the one holding ``row``; that one's first row
    for number in range(shard.metadata.num_row_groups):
        group_start += shard.metadata.row_group(number).num_rows
        if group_start > row:
            groups.append(number)
        elif not groups:
            first_row = group_start
    at = first_row
    for batch in shard.iter_batches(batch_size=BATCH_ROWS, row_groups=groups, columns=sorted(set(wanted))):
        for values in batch.to_pylist():
            at += 1
            if at <= row:
                continue
            yield at - 1, _record(path, at, values, chosen, fields, caption_prompt, media_root)


def _record(
    path: Path, number: int, values: dict[str, Any], chosen: dict[str, str | None], fields: FieldNames, prompt: str, root: Path
) -> Record:
    sample_id = str(values[chosen["id"]]) if chosen["id"] and values.get(chosen["id"]) is not None else f"{path.name}:{number}"
    where = f"{path}: row {number} (id {sample_id!r})"
    try:
        if chosen["turns"] and values.get(chosen["turns"]):
            turns = _turns(values[chosen["turns"]], where)
        elif chosen["prompt"] and values.get(fields.prompt) and values.get(fields.response):
            turns = [(USER, values[fields.prompt]), (ASSISTANT, values[fields.response])]
        elif chosen["caption"] and isinstance(values.get(chosen["caption"]), str) and values[chosen["caption"]].strip():
            turns = [(USER, prompt), (ASSISTANT, values[chosen["caption"]].strip())]
        else:
            return Record(sample_id, number, where, [], problem="no text in the row")
    except RecordError as err:
        return Record(sample_id, number, where, [], problem=str(err).removeprefix(f"{where}: "))
    try:
        images = _media(values.get(chosen["image"] or ""), where, root)
        audios = _media(values.get(chosen["audio"] or ""), where, root)
    except (ValueError, RuntimeError, TypeError) as err:  # decoded audio soundfile cannot write: this row is bad
        return Record(sample_id, number, where, [], problem=f"unreadable media in the row ({err})")
    return conversation_record(
        sample_id, number, where, turns, images[0] if images else None, audios[0] if audios else None,
        {"image": len(images), "audio": len(audios)},
    )  # fmt: skip
