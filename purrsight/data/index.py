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
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from purrsight.data.formats.records import prompt_problem
from purrsight.errors import UserError

if TYPE_CHECKING:
    from collections.abc import Iterator

    import pyarrow

    from purrsight.data.formats.records import ReadOptions, Record

REQUIRED_TEXT_FIELDS = ("id", "prompt", "response")
MEDIA_FIELDS = ("image", "audio")


# Problems listed in one pass when a caller asks for all of them (prepare, a training start, the
# launcher's data check): every missing file of a million-line index named at once, not one per run.
MAX_LISTED_PROBLEMS = 50


class IndexFileError(UserError):
    """A problem in an index file; the message names file, line and sample id."""


class RecordTable:
    """Validated index records in one Arrow table, read back one record at a time.

    One buffer per column instead of a million dicts: loader workers forked from the trainer
    share it, where touching Python objects would copy their pages one reference count at a
    time. Plain pyarrow, in memory: no cache folder for many nodes to race on, and none of
    `datasets`' import cost in every trainer process (bench/results/data.md, "The raw index in memory"; prepared
    sets use `datasets`).
    """

    def __init__(self, records: list[dict[str, Any]]) -> None:
        import pyarrow as pa

        text, number = pa.string(), pa.int32()
        # turns: a conversation's (role, text) pairs as JSON, where prompt/response cannot hold it;
        # problem: why a record of another format cannot train (a bad sample when read).
        fields = (*REQUIRED_TEXT_FIELDS, *MEDIA_FIELDS)
        # chars: a conversation's characters, its text's (the length grouping's proxy; null without turns).
        columns = [("line", number), ("turns", text), ("problem", text), ("chars", number)]
        schema = pa.schema([(f, text) for f in fields] + columns)
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


def check_record(record: Any, where: str, root: Path, check_media: bool) -> dict[str, Any]:
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


def read_index(
    path: str | Path, check_media: bool = True, max_problems: int = 1, fmt: str = "auto", options: ReadOptions | None = None
) -> list[dict[str, Any]]:
    """Validate every line; raise IndexFileError naming where each problem is.

    Stops at the first problem by default; ``max_problems`` > 1 goes on and lists up to that
    many (the dataset job reports a whole index in one round trip). ``check_media=False``
    leaves the media files alone: no metadata call per line (they are opened when decoded).
    Imports nothing heavy: the launcher's health check calls this.

    A LLaVA or messages file (data/formats) gives records of the same shape: a conversation of
    one user and one assistant turn as prompt and response, a longer one in ``turns`` too, and
    media paths joined to their root.
    """
    from purrsight.data.formats.sources import SHARD_FORMATS, detect, is_pattern

    if is_pattern(str(path)):
        raise IndexFileError(
            f"{path}: a pattern of files trains from a prepared set: run `python train_phase2.py prepare --config CONFIG`, "
            "then train with data.prepared=DIR"
        )
    path = Path(path)
    if not path.is_file():
        raise IndexFileError(f"{path}: index file does not exist")
    options = options or _default_options()
    fmt = detect([path], fmt, options.fields)
    if fmt in SHARD_FORMATS:
        raise IndexFileError(
            f"{path}: {fmt} shards train from a prepared set: run `python train_phase2.py prepare --config CONFIG`, "
            "then train with data.prepared=DIR (docs/DATA.md)"
        )
    if fmt != "purrsight":
        return _conversation_index(path, fmt, check_media, max_problems, options)
    # data.media_root means the same for every format, raw or prepared: our JSONL's paths are joined
    # to it here as a LLaVA file's are (prepared, they always were; raw, they were the file's folder's).
    root = (options or _default_options()).root_of(path)
    records: list[dict[str, Any]] = []
    problems: list[str] = []
    seen_ids: dict[str, int] = {}
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                clean = check_record(_parse(line, where), where, root, check_media)
                if clean["id"] in seen_ids:
                    raise IndexFileError(f"{where}: duplicate id {clean['id']!r} (first on line {seen_ids[clean['id']]})")
            except IndexFileError as err:
                problems.append(str(err))
                if len(problems) >= max_problems:
                    break
                continue
            seen_ids[clean["id"]] = number
            problem = prompt_problem(clean["prompt"], clean["response"], clean["image"] is not None, clean["audio"] is not None)
            if root != path.parent:  # the dataset joins a relative path to the index's folder
                clean |= {k: os.path.abspath(root / clean[k]) for k in MEDIA_FIELDS if clean[k] is not None}
            records.append({**clean, "line": number, "problem": problem})  # decode errors in training name it too
    if problems:
        if len(problems) == 1:  # one line says it all
            raise IndexFileError(problems[0])
        more = f" (the first {max_problems}; the scan stopped there)" if len(problems) >= max_problems else ""
        raise IndexFileError(problems=[*problems, f"{path}: {len(problems)} bad line(s){more}"])
    if not records:
        raise IndexFileError(f"{path}: index holds no samples")
    return records


def _default_options() -> ReadOptions:
    from purrsight.data.formats.records import ReadOptions

    return ReadOptions()


def _conversation_index(path: Path, fmt: str, check_media: bool, max_problems: int, options: ReadOptions) -> list[dict[str, Any]]:
    """read_index() of a LLaVA or messages file: a bad record (records.Record.problem) is kept, flagged."""
    from purrsight.data.formats.conversations import conversation_from
    from purrsight.data.formats.json_values import iter_values
    from purrsight.data.formats.records import RecordError

    def read_records() -> Iterator[Record | RecordError]:
        for number, _, value in iter_values(path):
            if isinstance(value, RecordError):
                yield value
                continue
            try:
                yield conversation_from(value, path, number, options.fields, options.root_of(path))
            except RecordError as err:
                yield err

    records: list[dict[str, Any]] = []
    problems: list[str] = []
    try:
        for record in read_records():
            if isinstance(record, RecordError):
                problems.append(str(record))
                if len(problems) >= max_problems:
                    break
                continue
            media = {"image": record.image, "audio": record.audio}
            missing = [
                f"{kind} file {where} does not exist"
                for kind, where in media.items()
                if where is not None and check_media and not Path(str(where)).is_file()
            ]
            if missing:
                problems.append(f"{record.where}: {missing[0]}")
                if len(problems) >= max_problems:
                    break
                continue
            single = record.single_turn
            first_user = next((text for role, text in record.turns if role == "user"), "")
            first_answer = next((text for role, text in record.turns if role == "assistant"), "")
            records.append(
                {
                    "id": record.id,
                    "prompt": single[0] if single else first_user,
                    "response": single[1] if single else first_answer,
                    **{kind: None if where is None else os.path.abspath(str(where)) for kind, where in media.items()},
                    "line": record.line,
                    "turns": None if single or record.problem else json.dumps(record.turns),
                    "chars": None if single or record.problem else sum(len(text) for _, text in record.turns),
                    "problem": record.problem,
                }
            )
    except RecordError as err:  # an array that cannot be read past a point
        problems.append(str(err))
    if problems:
        raise IndexFileError(problems=problems) if max_problems > 1 else IndexFileError(problems[0])
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
