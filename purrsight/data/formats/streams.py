"""Any format's records from a resume point, through one interface (sources.py names the format)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from purrsight.data.formats.conversations import conversation_from
from purrsight.data.formats.json_values import iter_values
from purrsight.data.formats.records import ReadOptions, Record, RecordError

__all__ = ["ReadOptions", "read_records"]


def read_records(
    path: Path, fmt: str, offset: int = 0, ordinal: int = 0, options: ReadOptions | None = None, load_media: bool = True
) -> Iterator[tuple[int, Record | RecordError]]:
    """(resume offset, Record or the error that made the record unreadable), from (offset, ordinal) on.

    The resume offset of a record, with ``record.line - 1`` as the ordinal, starts a later read at it:
    a byte offset (JSON, tar) or a row (Parquet).
    """
    options = options or ReadOptions()
    root = options.root_of(path)
    if fmt == "purrsight":
        from purrsight.data.formats.plain import plain_records

        yield from plain_records(path, offset, ordinal, root)
    elif fmt in ("llava", "messages"):
        for number, start, value in iter_values(path, offset, ordinal):
            if isinstance(value, RecordError):
                yield start, value
                continue
            try:
                yield start, conversation_from(value, path, number, options.fields, root)
            except RecordError as err:
                yield start, err
    elif fmt == "webdataset":
        from purrsight.data.formats.tar_shards import tar_records

        yield from tar_records(path, offset, ordinal, options.fields, options.caption_prompt, load_media)
    elif fmt == "parquet":
        from purrsight.data.formats.parquet_shards import parquet_records

        yield from parquet_records(path, offset, options.fields, options.caption_prompt, root, load_media)
    else:
        raise ValueError(f"unknown format {fmt!r}")
