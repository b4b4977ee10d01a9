"""Our own JSONL index (data/index.py describes it), streamed as Records from a byte offset."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from purrsight.data.formats.json_values import iter_values
from purrsight.data.formats.records import ASSISTANT, USER, Record, RecordError, prompt_problem
from purrsight.data.index import IndexFileError, check_record


def plain_records(path: Path, offset: int, ordinal: int, media_root: Path) -> Iterator[tuple[int, Record | RecordError]]:
    """(byte offset, Record) for each line from ``offset`` on; a bad line's error in the Record's place."""
    for number, start, value in iter_values(path, offset, ordinal):
        where = f"{path}:{number}"
        if isinstance(value, RecordError):
            yield start, value
            continue
        try:
            clean = check_record(value, where, media_root, check_media=False)
        except IndexFileError as err:
            yield start, RecordError(str(err))
            continue
        turns = [(USER, clean["prompt"]), (ASSISTANT, clean["response"])]
        image = media_root / clean["image"] if clean["image"] else None
        audio = media_root / clean["audio"] if clean["audio"] else None
        problem = prompt_problem(clean["prompt"], clean["response"], image is not None, audio is not None)
        yield start, Record(clean["id"], number, f"{where} (id {clean['id']!r})", turns, image, audio, problem)
