"""The JSONL sample index: scanned line by line before training, then held in an Arrow table.

One sample per line::

    {"id": "s1", "prompt": "What colour is the cat?", "response": "The cat is red.",
     "image": "images/s1.png", "audio": "audio/s1.wav"}

``image`` and ``audio`` are optional and relative to the index file's folder. The scan
reads every line before any process starts training so that a typo on line 90,000 stops
the run at minute zero, not at hour three, and names the file, line and sample id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from purrsight.errors import UserError

if TYPE_CHECKING:
    from collections.abc import Iterator

    import pyarrow

REQUIRED_TEXT_FIELDS = ("id", "prompt", "response")
MEDIA_FIELDS = ("image", "audio")


class IndexFileError(UserError):
    """A problem in an index file; the message names file, line and sample id."""


class RecordTable:
    """Validated index records in one Arrow table, read back one record at a time.

    One buffer per column instead of a million dicts: loader workers forked from the trainer
    share it, where touching Python objects would copy their pages one reference count at a
    time. Plain pyarrow, in memory: no cache folder for many nodes to race on, and none of
    `datasets`' import cost in every trainer process (bench/README.md, "The raw index in memory"; prepared
    sets use `datasets`).
    """

    def __init__(self, records: list[dict[str, Any]]) -> None:
        import pyarrow as pa

        text, number = pa.string(), pa.int32()
        schema = pa.schema([(f, text) for f in (*REQUIRED_TEXT_FIELDS, *MEDIA_FIELDS)] + [("line", number)])
        self.table: pyarrow.Table = pa.Table.from_pylist(records, schema=schema)

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):  # slice() would clamp it silently
            raise IndexError(f"record {i} of {len(self)}")
        return self.table.slice(i, 1).to_pylist()[0]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.table.to_batches():
            yield from batch.to_pylist()


@dataclass(frozen=True)
class SampleIndex:
    path: Path
    records: RecordTable

    @property
    def root(self) -> Path:
        return self.path.parent

    def __len__(self) -> int:
        return len(self.records)


def _check_record(record: Any, where: str, root: Path, check_media: bool) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise IndexFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
    sample_id = record.get("id")
    label = f"{where} (id {sample_id!r})" if sample_id is not None else where
    for field in REQUIRED_TEXT_FIELDS:
        if field not in record:
            raise IndexFileError(f"{label}: missing field {field!r}")
        if not isinstance(record[field], str) or not record[field].strip():
            raise IndexFileError(f"{label}: field {field!r} must be a non-empty string")
    clean = {field: record[field] for field in REQUIRED_TEXT_FIELDS}
    for field in MEDIA_FIELDS:
        value = record.get(field)
        if value is None:
            clean[field] = None
            continue
        if not isinstance(value, str):
            raise IndexFileError(f"{label}: field {field!r} must be a path string or null")
        if check_media and not (root / value).is_file():  # one metadata call: at scale, only one process makes it
            raise IndexFileError(f"{label}: {field} file {root / value} does not exist")
        clean[field] = value
    unknown = sorted(set(record) - set(REQUIRED_TEXT_FIELDS) - set(MEDIA_FIELDS))
    if unknown:
        raise IndexFileError(f"{label}: unknown field(s) {', '.join(unknown)} (allowed: id, prompt, response, image, audio)")
    return clean


def read_index(path: str | Path, check_media: bool = True, max_problems: int = 1) -> list[dict[str, Any]]:
    """Validate every line; raise IndexFileError naming where each problem is.

    Stops at the first problem by default; ``max_problems`` > 1 goes on and lists up to that
    many (the dataset job reports a whole index in one round trip). ``check_media=False``
    leaves the media files alone: no metadata call per line (they are opened when decoded).
    Imports nothing heavy: the launcher's health check calls this.
    """
    path = Path(path)
    if not path.is_file():
        raise IndexFileError(f"{path}: index file does not exist")
    records: list[dict[str, Any]] = []
    problems: list[str] = []
    seen_ids: dict[str, int] = {}
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                clean = _check_record(_parse(line, where), where, path.parent, check_media)
                if clean["id"] in seen_ids:
                    raise IndexFileError(f"{where}: duplicate id {clean['id']!r} (first on line {seen_ids[clean['id']]})")
            except IndexFileError as err:
                problems.append(str(err))
                if len(problems) >= max_problems:
                    break
                continue
            seen_ids[clean["id"]] = number
            records.append({**clean, "line": number})  # decode errors in training name it too
    if problems:
        if max_problems == 1:
            raise IndexFileError(problems[0])
        more = f" (the first {max_problems}; the scan stopped there)" if len(problems) >= max_problems else ""
        raise IndexFileError(problems=[*problems, f"{path}: {len(problems)} bad line(s){more}"])
    if not records:
        raise IndexFileError(f"{path}: index holds no samples")
    return records


def _parse(line: str, where: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise IndexFileError(f"{where}: malformed JSON ({err.msg} at column {err.colno})") from None


def scan_index(path: str | Path, check_media: bool = True) -> SampleIndex:
    """read_index(), then the records in an Arrow table."""
    return SampleIndex(path=Path(path), records=RecordTable(read_index(path, check_media)))
