"""A prepared dataset's folder: its layout, manifest and digests (no torch: the health check reads it).

A prepared dataset holds every sample decoded once, in memory-mapped Arrow shards (data/prepared.py).
Training from one opens no original file: a sample is a row of an Arrow file (pyarrow maps it
into memory, so the ranks of a node share one copy in the page cache), and its
per-sample work is reading and normalising. Made by ``python train_phase2.py prepare``
(datasets/prepare_job.py); this module knows the folder's layout and reads it::

    DIR/plan.json                 what is being prepared: sources, settings, shards (written first)
    DIR/train/shard-00000.arrow   samples of the training index, in index order (one Arrow stream)
    DIR/train/shard-00000.json    the shard's receipt: rows and bad samples (written after its data)
    DIR/val/...                   the validation index, the same way
    DIR/bad_samples.jsonl         samples left out (data.on_bad_sample: skip), one per line
    DIR/manifest.json             written last, atomically, once every shard exists: the set is whole

Every file is written to a temporary name and renamed (purrsight/atomic_file.py), so a prepare
killed half-way leaves whole shards, hidden ``.shard-….tmp`` files and no manifest: it is never
taken for complete, and a second prepare removes the temp files and continues. The manifest is
written only while the samples left out, counted over every shard's receipt, stay within
data.max_bad_samples, whichever run or part prepared the shards.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from purrsight.data.formats.sources import SourceError, file_digest, sources_digest
from purrsight.errors import UserError

FORMAT_VERSION = 1
PLAN_NAME = "plan.json"
MANIFEST_NAME = "manifest.json"
BAD_SAMPLES_NAME = "bad_samples.jsonl"


class PreparedSetError(UserError):
    """A prepared set that cannot be used as it is; the message says what differs and what to run."""


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


TOKENIZER_FILE_PREFIXES = ("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template", "spiece")


def tokenizer_digest(folder: Path) -> str:
    """sha256 over the names and bytes of a tokenizer's files in ``folder``.

    Only the tokenizer's own files: the folder is often the LLM's, whose weights (gigabytes)
    have no say in the token ids and would be read on every start.
    """
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name.startswith(TOKENIZER_FILE_PREFIXES)):
        digest.update(path.name.encode() + b"\0" + file_digest(path).encode())
    return digest.hexdigest()


def shard_name(split: str, number: int) -> str:
    return f"{split}/shard-{number:05d}"


def differences(expected: Any, found: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two JSON-like trees."""
    if isinstance(expected, dict) and isinstance(found, dict):
        keys = sorted(set(expected) | set(found))
        return [d for key in keys for d in differences(expected.get(key), found.get(key), f"{prefix}{key}.")]
    return [] if expected == found else [prefix.rstrip(".")]


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a complete prepared set; PreparedSetError naming what to run when there is none."""
    path = folder / MANIFEST_NAME
    if not folder.is_dir():
        raise PreparedSetError(
            f"data.prepared: {folder} does not exist; make it with `python train_phase2.py prepare --config CONFIG`"
        )
    if not path.is_file():
        started = (folder / PLAN_NAME).is_file()
        what = "a prepare was interrupted or is still running" if started else "it holds no prepared set"
        raise PreparedSetError(
            f"data.prepared: {folder} is not complete (no {MANIFEST_NAME}: {what}); "
            "continue it with `python train_phase2.py prepare --config CONFIG` (the same overrides)"
        )
    try:
        manifest = read_json(path)
    except (OSError, ValueError) as err:
        raise PreparedSetError(f"data.prepared: cannot read {path} ({err})") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise PreparedSetError(
            f"data.prepared: {folder} has format {manifest.get('format')}, this version reads {FORMAT_VERSION}; prepare it again"
        )
    return dict(manifest)


def same_source(index: str, recorded: str) -> bool:
    """Whether ``index`` names the source a split was prepared from, as spelled or as resolved here."""
    return index == recorded or os.path.abspath(index) == os.path.abspath(recorded)


def _same_content(index: str, digest: str) -> bool:
    try:
        return bool(sources_digest(index) == digest)
    except (OSError, SourceError):
        return False


def check_sources(manifest: dict[str, Any], folder: Path, indexes: dict[str, str | None], overridden: frozenset[str]) -> None:
    """PreparedSetError when an index this command's overrides name (``overridden``: ``data.train_index``
    ...) is not the source its split was prepared from (by its path, else by its content: read only
    then). A prepared set trains alone, its sources neither needed nor hashed at a start; the config
    file's own index is its raw path's,
    not this run's (the README's flow: a config, `prepare` with `data.train_index=shards/...`, then
    `data.prepared=DIR`)."""
    for split, index in indexes.items():
        source = manifest["sources"].get(split)
        if index is None or source is None or same_source(index, source["index"]) or f"data.{split}_index" not in overridden:
            continue
        # Named by this command, spelled otherwise than at the prepare (another folder, a relative
        # path): the same content is the same source. Read only here, where the command asked.
        if not _same_content(index, source["sha256"]):
            raise PreparedSetError(
                f"data.{split}_index={index} names other data than data.prepared={folder} was made from ({source['index']}, "
                f"{source['records']} samples): a prepared set trains alone; drop data.{split}_index, or prepare {index} "
                "into another --out"
            )
