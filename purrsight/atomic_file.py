"""Files that are whole or absent, also after a crash: the one way PurrSight publishes a file.

Written to a temporary name beside the target, flushed and fsynced, renamed over the target,
and the folder fsynced so the rename itself survives a power cut. The temporary name carries
the host, the process and a random part: two hosts writing into one shared folder can share a
pid, and two writers must never write into one temp file. A reader (or a second writer) sees
the old file or the new one, never half of one; a writer that dies leaves a ``.*.tmp`` file
that ``stale_temp_files`` finds. What is published in order (a prepared set's shards, then its
manifest) reaches the disk in that order.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

TEMP_SUFFIX = ".tmp"


def temp_name(path: Path) -> Path:
    """A temporary name beside ``path``, unique to this host, process and call."""
    return path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(3)}{TEMP_SUFFIX}")


def stale_temp_files(folder: Path) -> list[Path]:
    """Temporary files left in ``folder`` by writers that died."""
    return sorted(folder.glob(f".*{TEMP_SUFFIX}"))


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


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` at ``path``, or nothing there: a reader (or a second writer) never sees half a file."""
    publish(path, lambda stream: stream.write(data))


def write_text_atomically(path: Path, text: str) -> None:
    write_atomically(path, text.encode())


def write_json_atomically(path: Path, value: Any) -> None:
    write_text_atomically(path, json.dumps(value, indent=1, sort_keys=True) + "\n")
