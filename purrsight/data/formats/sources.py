"""data.train_index / data.val_index: a path or a glob (brace ranges too) -> files, their format, a digest.

``shards/{00000..00999}.tar`` expands like the shell's (zero-padded ranges, ``{a,b}`` lists), then
``*``, ``?`` and ``[...]`` like glob's; the files in order. The format is named by data.format or
told from the files: ``.tar`` WebDataset shards, ``.parquet`` Parquet shards, ``.json`` / ``.jsonl``
by their first record (turns with from/value: LLaVA; role/content: messages; prompt/response: ours).
"""

from __future__ import annotations

import glob
import hashlib
import re
from pathlib import Path

from purrsight.data.formats.json_values import iter_values
from purrsight.data.formats.records import FieldNames, RecordError

FORMATS = ("purrsight", "llava", "messages", "webdataset", "parquet")
SHARD_FORMATS = ("webdataset", "parquet")  # trained from a prepared set only
BRACES = re.compile(r"\{([^{}]*)\}")
RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")
DIGEST_EDGE = 1 << 20  # a set of many shards is fingerprinted by each one's size and first and last MiB


class SourceError(RecordError):
    """data.*_index names no file, or files of no format we read."""


def expand_braces(pattern: str) -> list[str]:
    match = BRACES.search(pattern)
    if match is None:
        return [pattern]
    body, head, tail = match.group(1), pattern[: match.start()], pattern[match.end() :]
    numbers = RANGE.match(body)
    if numbers:
        first, last = int(numbers.group(1)), int(numbers.group(2))
        width = len(numbers.group(1)) if numbers.group(1).startswith("0") else 0
        step = 1 if last >= first else -1
        choices = [str(n).zfill(width) for n in range(first, last + step, step)]
    elif "," in body:
        choices = body.split(",")
    else:
        return [head + "{" + body + "}" + rest for rest in expand_braces(tail)]  # literal braces, as the shell keeps them
    return [expanded for choice in choices for expanded in expand_braces(head + choice + tail)]


def expand(spec: str) -> list[Path]:
    """The files ``spec`` names, in order; SourceError naming the spec when none exists."""
    files: list[Path] = []
    seen: set[Path] = set()
    for pattern in expand_braces(spec):
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        for match in matches:
            path = Path(match)
            if path.is_file() and path not in seen:
                seen.add(path)
                files.append(path)
            elif not glob.has_magic(pattern) and not path.is_file():
                raise SourceError(f"{path}: index file does not exist" + (f" (from {spec})" if pattern != spec else ""))
    if not files:
        raise SourceError(f"{spec}: no file matches")
    return files


def is_pattern(spec: str) -> bool:
    return spec != expand_braces(spec)[0] or len(expand_braces(spec)) > 1 or glob.has_magic(spec)


def _first_value_format(path: Path, fields: FieldNames) -> str:
    """llava or messages by the first record's turns; else ours (whose scan names what a line lacks)."""
    from purrsight.data.formats.conversations import turn_style

    for _, _, value in iter_values(path):
        return turn_style(value, fields) or "purrsight"
    return "purrsight"


def detect(files: list[Path], named: str = "auto", fields: FieldNames | None = None) -> str:
    """The files' format: ``named`` unless it is auto; else told from the first file."""
    if named != "auto":
        return named
    first = files[0]
    suffixes = {path.suffix.lower() for path in files}
    if len(suffixes) > 1:
        raise SourceError(f"{first.parent}: files of several kinds ({', '.join(sorted(suffixes))}); one format per index")
    suffix = first.suffix.lower()
    if suffix == ".tar":
        return "webdataset"
    if suffix == ".parquet":
        return "parquet"
    if suffix in (".tgz", ".gz", ".zst", ".xz", ".bz2"):
        raise SourceError(f"{first}: compressed shards are not read; decompress to .tar (streamed, never unpacked)")
    return _first_value_format(first, fields or FieldNames())


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (an index of a million lines: about a second)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _edges_digest(path: Path) -> str:
    digest = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as handle:
        digest.update(handle.read(DIGEST_EDGE))
        if size > DIGEST_EDGE:
            handle.seek(max(DIGEST_EDGE, size - DIGEST_EDGE))
            digest.update(handle.read(DIGEST_EDGE))
    return digest.hexdigest()


def sources_digest(spec: str) -> str:
    """One file: the sha256 of its bytes. A pattern: of each file's name, size, first and last MiB
    (ten thousand shards are not read whole at every start; a shard rewritten in its middle at the
    same size goes unseen: prepare into a new folder when a set is rebuilt)."""
    if not is_pattern(spec):
        return file_digest(Path(spec))
    digest = hashlib.sha256()
    for path in expand(spec):
        digest.update(f"{path.name}\0{path.stat().st_size}\0{_edges_digest(path)}\n".encode())
    return digest.hexdigest()
