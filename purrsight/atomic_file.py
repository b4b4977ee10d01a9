"""Files that are whole or absent, also after a crash: the one way PurrSight publishes a file.

Written to a temporary name beside the target, flushed and fsynced, renamed over the target,
and the folder fsynced so the rename itself survives a power cut. The temporary name carries
the host, the process and a random part: two hosts writing into one shared folder can share a
pid, and two writers must never write into one temp file. A reader (or a second writer) sees
the old file or the new one, never half of one; a writer that dies leaves a ``.*.tmp`` file
that ``stale_temp_files`` finds. What is published in order (a prepared set's shards, then its
manifest) reaches the disk in that order.

A folder (an export) is published the same way: written whole into a temporary folder beside it,
every file and folder in it fsynced, then renamed into place (``publishing_folder``); a marker
inside the temporary folder names the folder it is for, so a sweep never takes another's.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

TEMP_SUFFIX = ".tmp"
PUBLISHING_MARKER = ".publishing"  # inside a folder being published: the name of the folder it becomes


def temp_name(path: Path) -> Path:
    """A temporary name beside ``path``, unique to this host, process and call."""
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(3)}{TEMP_SUFFIX}")


def stale_temp_files(folder: Path, of: str | None = None) -> list[Path]:
    """Temporary files left in ``folder`` by writers that died; ``of``: only those of the file named so
    (its temporary name starts with ``.{of}.``: the folder must publish no other file named ``{of}.…``)."""
    return sorted(folder.glob(f".{glob.escape(of)}.*{TEMP_SUFFIX}" if of else f".*{TEMP_SUFFIX}"))


def remove_stale_temp_files(folder: Path, *names: str) -> list[Path]:
    """Remove what writers of ``names`` in ``folder`` left when they died; returns what was removed.

    Only where no writer of those files can be alive: the one process that writes them, at its start.
    """
    removed = [stale for name in names for stale in stale_temp_files(folder, name)]
    for stale in removed:
        stale.unlink(missing_ok=True)
    return removed


def sync_folder(folder: Path) -> None:
    """Make the folder's entries (a rename, a new file) durable."""
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


@contextmanager
def publishing(path: Path) -> Iterator[IO[bytes]]:
    """A binary stream whose content becomes ``path`` when the block ends without an error.

    On an error (or a KeyboardInterrupt) the temporary file is removed and ``path`` is left as
    it was.
    """
    tmp = temp_name(path)
    try:
        with tmp.open("wb") as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_folder(path.parent)


def publish(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """``write(stream)`` into a temporary file, then published whole at ``path``."""
    with publishing(path) as stream:
        write(stream)


def copy_atomically(source: Path, target: Path) -> None:
    """A copy of ``source`` published whole at ``target`` (its old content stays until the copy is whole)."""
    with source.open("rb") as reading:
        publish(target, lambda stream: shutil.copyfileobj(reading, stream, 16 * 2**20))


def link_atomically(source: Path, target: Path) -> None:
    """``target`` made a hard link to ``source``, replacing what was there in one rename.

    OSError where the filesystem has no hard links (the caller copies then). The link's temporary
    name is as unique as a file's: two writers (two hosts on one shared folder) never collide on it.
    """
    tmp = temp_name(target)
    os.link(source, tmp)
    try:
        os.replace(tmp, target)
    finally:
        # Gone after a rename; still there after a failed one, or when ``target`` already was
        # this file (rename(2) then does nothing and leaves both names).
        tmp.unlink(missing_ok=True)
    sync_folder(target.parent)


def _sync_tree(folder: Path) -> None:
    """fsync every file under ``folder``, then every folder, deepest first (a file before its entry)."""
    folders = [folder]
    for path in sorted(folder.rglob("*")):
        if path.is_dir():
            folders.append(path)
        else:
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    for each in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        sync_folder(each)


@contextmanager
def publishing_folder(path: Path) -> Iterator[Path]:
    """A temporary folder beside ``path`` that becomes ``path`` when the block ends without an error.

    ``path`` must not exist, or be an empty folder: one rename cannot replace a folder that holds
    files, and what it holds is not ours to delete (the rename fails with OSError, ENOTEMPTY).
    On an error (or a KeyboardInterrupt) the temporary folder is removed and ``path`` is left as
    it was; a writer killed outright leaves a hidden ``.*.tmp`` folder that ``stale_temp_folders``
    finds by the marker inside it (``PUBLISHING_MARKER``), removed just before the rename.
    """
    tmp = temp_name(path)
    tmp.mkdir()
    marker = tmp / PUBLISHING_MARKER
    try:
        marker.write_text(path.name)
        yield tmp
        _sync_tree(tmp)
        marker.unlink()
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    sync_folder(path.parent)


def stale_temp_folders(path: Path) -> list[Path]:
    """The temporary folders that writers of ``path`` killed half way left beside it.

    Told by the marker inside, not by the name alone: ``.model.*.tmp`` also matches what a writer of
    ``model.v2`` leaves (``.model.v2.<host>.<pid>.<random>.tmp``), and a host's name may hold dots.
    """
    found = []
    for candidate in path.parent.glob(f".{glob.escape(path.name)}.*{TEMP_SUFFIX}"):
        try:
            if (candidate / PUBLISHING_MARKER).read_text() == path.name:
                found.append(candidate)
        except OSError:  # not a folder, no marker (a folder of another kind, or of an older version)
            continue
    return sorted(found)


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` at ``path``, or nothing there: a reader (or a second writer) never sees half a file."""
    publish(path, lambda stream: stream.write(data))


def write_text_atomically(path: Path, text: str) -> None:
    write_atomically(path, text.encode())


def write_json_atomically(path: Path, value: Any) -> None:
    write_text_atomically(path, json.dumps(value, indent=1, sort_keys=True) + "\n")
