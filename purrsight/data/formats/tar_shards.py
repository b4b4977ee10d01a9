"""WebDataset tar shards (img2dataset's layout), streamed with ``tarfile``, never unpacked.

A sample is the run of consecutive members that share a key (the member's path up to the first
dot of its name): ``000001234.jpg``, ``000001234.txt``, ``000001234.json``; audio as ``.flac`` or
``.wav``. Which extension is which part: data.fields (``image``, ``audio``, ``caption``). The text
is, first found: the ``.json``'s turns (data.fields.conversations), its prompt and response, the
``.txt`` caption, the ``.json``'s caption; a caption trains as the response to data.caption_prompt.

The shard is opened as a seekable file: members not needed are stepped over, and a prepare
worker starts at its first sample's header (a byte offset) instead of reading what is before it.
A member without its pair (a picture without text, a caption without media) is a bad sample.
"""

from __future__ import annotations

import json
import posixpath
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from purrsight.data.formats.conversations import _turns, turns_key
from purrsight.data.formats.records import (
    ASSISTANT,
    USER,
    DamagedFileError,
    FieldNames,
    MediaBlob,
    Record,
    RecordError,
    Turn,
    conversation_record,
)


def _text_of(members: dict[str, bytes], fields: FieldNames, caption_prompt: str, where: str) -> list[Turn] | str:
    """The sample's turns, or why there are none."""
    meta: Any = None
    if "json" in members:
        try:
            meta = json.loads(members["json"])
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return f".json is not JSON ({err})"
    if isinstance(meta, dict):
        if turns_key(meta, fields) is not None:
            try:
                return _turns(meta[turns_key(meta, fields) or ""], where)
            except RecordError as err:
                return str(err).removeprefix(f"{where}: ")
        if isinstance(meta.get(fields.prompt), str) and isinstance(meta.get(fields.response), str):
            return [(USER, meta[fields.prompt]), (ASSISTANT, meta[fields.response])]
    for ext in fields.caption:
        if ext in members:
            try:
                return [(USER, caption_prompt), (ASSISTANT, members[ext].decode("utf-8").strip())]
            except UnicodeDecodeError:
                return f".{ext} is not UTF-8 text"
    if isinstance(meta, dict):
        caption = next((meta[key] for key in fields.caption if isinstance(meta.get(key), str)), None)
        if caption:
            return [(USER, caption_prompt), (ASSISTANT, caption.strip())]
    return ""


def _pairing_hint(key: str, members: dict[str, bytes], fields: FieldNames, apart: bool) -> str:
    """Why a member found no pair, where the tar says more than "without its pair"."""
    known = set(fields.image) | set(fields.audio) | set(fields.caption) | {"json"}
    dotted = sorted(ext for ext in members if "." in ext and ext not in known)
    if dotted:
        stem = posixpath.basename(key)
        return (
            f": WebDataset splits a name at its first dot, so {stem}.{dotted[0]} is key {stem!r} with extension "
            f"{dotted[0]!r}; name the members KEY.EXT with no dot in KEY"
        )
    if apart:
        return (
            f": key {posixpath.basename(key)!r} also stands elsewhere in the shard, apart from these members; WebDataset "
            "pairs adjacent members only: write the tar sorted by name (tar --sort=name)"
        )
    return ""


def _sample(
    path: Path, number: int, key: str, members: dict[str, bytes], fields: FieldNames, caption_prompt: str, apart: bool = False
) -> Record:
    """The Record of one key's members; ``apart``: the key also stands elsewhere in the shard."""
    where = f"{path}:{key}"
    media: dict[str, MediaBlob | None] = {}
    for modality in ("image", "audio"):
        ext = next((e for e in getattr(fields, modality) if e in members), None)
        media[modality] = None if ext is None else MediaBlob(members[ext], f"{path}:{key}.{ext}")
    turns = _text_of(members, fields, caption_prompt, where)
    names = ", ".join(f"{key}.{ext}" for ext in sorted(members))
    problem = None
    hint = _pairing_hint(key, members, fields, apart)
    if turns == "":
        problem = f"{names} without its text pair (.{' / .'.join(fields.caption[:1])} caption or .json){hint}"
    elif isinstance(turns, str):
        problem = turns
    elif media["image"] is None and media["audio"] is None:
        problem = f"{names} without its media pair (.{' / .'.join(fields.image[:3] + fields.audio[:2])}){hint}"
    if problem is not None:
        return Record(key, number, where, [], problem=problem)
    assert isinstance(turns, list)
    return conversation_record(key, number, where, turns, media["image"], media["audio"], {})


def tar_records(
    path: Path, offset: int, ordinal: int, fields: FieldNames, caption_prompt: str, load_media: bool = True
) -> Iterator[tuple[int, Record | RecordError]]:
    """(byte offset of the sample's first member, Record) for each sample from ``offset`` on.

    ``load_media=False`` (a scan that only counts and checks) reads the text members only.
    """
    wanted_media = set(fields.image) | set(fields.audio)
    with path.open("rb") as handle:
        handle.seek(offset)
        try:
            tar = tarfile.open(fileobj=handle, mode="r:")  # noqa: SIM115 (the generator below holds it; closing ``handle`` ends it)
        except tarfile.ReadError as err:
            if not offset:
                raise RecordError(f"{path}: not a readable tar file ({err}); compressed tars: unpack to .tar first") from None
            ending = _ending_problem(handle, offset)  # the end-of-archive blocks (no sample after the offset), or damage
            if ending is not None:  # where a read from the start met it too: the same bad record
                yield offset, _damaged(path, ordinal, ending)
            return
        key: str | None = None
        start, members = offset, dict[str, bytes]()
        done: set[str] = set()  # keys already yielded: one seen again stands apart from its pair
        try:
            while (info := tar.next()) is not None:
                if not info.isfile():
                    continue
                folder, name = posixpath.split(info.name)
                if name.startswith("."):
                    continue  # ._ files of macOS's tar, hidden files
                stem, _, ext = name.partition(".")
                member_key = posixpath.join(folder, stem)
                if member_key != key:
                    if key is not None:
                        ordinal += 1
                        yield start, _sample(path, ordinal, key, members, fields, caption_prompt, key in done)
                        done.add(key)
                    tar.members.clear()  # type: ignore[attr-defined]  # next() keeps every header: memory would grow with the shard
                    key, start, members = member_key, info.offset, {}
                ext = ext.lower()
                if ext in wanted_media and not load_media:
                    members[ext] = b""
                    continue
                extracted = tar.extractfile(info)
                members[ext] = extracted.read() if extracted is not None else b""
            ending = _ending_problem(handle, tar.offset)
            if ending is not None and key is not None:  # the members read are whole: their sample stands
                ordinal += 1
                yield start, _sample(path, ordinal, key, members, fields, caption_prompt, key in done)
                key, start = None, tar.offset
        except (tarfile.TarError, OSError) as err:  # inside a member: that sample is part of the loss
            ending = f"({err})"
        if ending is not None:
            # A cut or damaged shard: the samples before the damage were yielded and stay; the rest
            # of the file is one bad record (skipped under data.on_bad_sample=skip, named under error).
            yield start, _damaged(path, ordinal, ending)
            return
        if key is not None:
            yield start, _sample(path, ordinal + 1, key, members, fields, caption_prompt, key in done)


def _damaged(path: Path, ordinal: int, ending: str) -> DamagedFileError:
    return DamagedFileError(str(path), f"tar file cut or damaged after sample {ordinal} {ending}; the rest of it is lost", ordinal)


END_OF_ARCHIVE = 2 * tarfile.BLOCKSIZE  # two zero blocks end a tar (POSIX); writers pad with more zeros


def _ending_problem(handle: Any, end: int) -> str | None:
    """Why a tar whose reading stopped at ``end`` did not end there as a tar ends, or None.

    tarfile stops silently at a header it cannot read past the first member (a bad checksum, a
    file cut at a member's boundary), as at the end-of-archive blocks: what follows ``end`` tells."""
    handle.seek(end)
    rest = handle.read(1 << 20)
    if len(rest) < END_OF_ARCHIVE:
        return f"(it ends {len(rest)} bytes after its last member, without the end-of-archive blocks: cut short)"
    if rest.count(0) != len(rest):
        return f"(an unreadable member header at byte {end})"
    return None
