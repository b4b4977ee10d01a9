"""JSON values one at a time from a JSONL file or a top-level JSON array, from a byte offset on.

A JSON array (LLaVA's ``llava_instruct_150k.json`` is one) is parsed element by element with
``json.JSONDecoder.raw_decode`` over a buffer read 1 MiB at a time, never loaded whole: a 3 GB
annotation file costs the largest record's size in memory, not the file's. Each value comes
with its byte offset, so a prepare worker seeks to its shard's first record instead of
parsing everything before it.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from purrsight.data.formats.records import RecordError

READ_BYTES = 1 << 20
MAX_RECORD_BYTES = 64 << 20  # one record larger than this is taken for a malformed file, not buffered on
WHITESPACE = " \t\r\n"


def is_json_array(path: Path) -> bool:
    """Whether the file's first non-blank byte opens an array (else it is read as JSON lines)."""
    with path.open("rb") as handle:
        while block := handle.read(4096):
            stripped = block.lstrip()
            if stripped:
                return stripped[:1] == b"["
    return False


def iter_values(path: Path, offset: int = 0, ordinal: int = 0) -> Iterator[tuple[int, int, Any]]:
    """(record number from 1: the line in JSONL, the element in an array; its byte offset; the value).

    ``offset`` and ``ordinal``: resume at a value an earlier pass yielded (its offset, its number - 1).
    Malformed JSON on a line comes as a RecordError value naming file and line (the next lines are
    still read, so that a scan lists them all); in an array, where nothing after it can be found,
    it is raised.
    """
    if is_json_array(path):
        yield from _array_values(path, offset, ordinal)
    else:
        yield from _line_values(path, offset, ordinal)


def _line_values(path: Path, offset: int, number: int) -> Iterator[tuple[int, int, Any]]:
    with path.open("rb") as handle:
        handle.seek(offset)
        position = offset
        for raw in handle:
            number += 1
            start, position = position, position + len(raw)
            if not raw.strip():
                continue
            try:
                value = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                detail = f"{err.msg} at column {err.colno}" if isinstance(err, json.JSONDecodeError) else "not UTF-8"
                yield number, start, RecordError(f"{path}:{number}: malformed JSON ({detail})")
                continue
            yield number, start, value


def _array_values(path: Path, offset: int, ordinal: int) -> Iterator[tuple[int, int, Any]]:
    decoder = json.JSONDecoder()
    text_decoder = codecs.getincrementaldecoder("utf-8")()
    with path.open("rb") as handle:
        if offset == 0:  # at the file's start: step over the opening bracket
            head = handle.read(READ_BYTES)
            stripped = head.lstrip()
            offset = len(head) - len(stripped) + 1
        handle.seek(offset)
        buffer, pos, at, eof = "", 0, offset, False  # at: the byte offset of buffer[pos]

        def more() -> bool:
            nonlocal buffer, eof
            block = handle.read(READ_BYTES)
            eof = not block
            buffer += text_decoder.decode(block, final=eof)
            return not eof

        while True:
            while pos < len(buffer) and buffer[pos] in WHITESPACE + ",":
                pos, at = pos + 1, at + 1  # ASCII: one byte each
            if pos == len(buffer):
                if not more() and pos == len(buffer):
                    raise RecordError(f"{path}: the JSON array is not closed (after record {ordinal})")
                continue
            if buffer[pos] == "]":
                return
            try:
                value, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError as err:
                if not eof and len(buffer) - pos < MAX_RECORD_BYTES and more():
                    continue  # the record runs past what is buffered
                raise RecordError(f"{path}: record {ordinal + 1}: malformed JSON ({err.msg})") from None
            ordinal += 1
            start = at
            at += len(buffer[pos:end].encode())
            pos = end
            if pos > READ_BYTES:  # drop what was read: the buffer stays about one read long
                buffer, pos = buffer[pos:], 0
            yield ordinal, start, value
