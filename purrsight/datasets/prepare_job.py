"""``python train_phase2.py prepare``: decode a dataset once into a prepared set (data/prepared.py).

Reads the config's indexes, validates every line (all problems listed, up to a cap), decodes
each sample the way training would (pictures to what the image tower takes, audio cut to the
window at the tower's rate, text tokenised) and writes memory-mapped Arrow shards, in
parallel over the machine's cores and, with ``--part I/N``, over machines (one part each; the
part that finishes last writes the manifest, or any later prepare does). Killed half-way, it
continues where it stopped: a shard is done when its receipt exists.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from purrsight.atomic_file import write_atomically
from purrsight.atomic_file import write_json_atomically as write_json
from purrsight.config import Config, load_config
from purrsight.data.index import read_index
from purrsight.data.media import SampleError
from purrsight.data.prepared import sample_row, write_shard
from purrsight.data.prepared_manifest import (
    BAD_SAMPLES_NAME,
    MANIFEST_NAME,
    PLAN_NAME,
    PreparedSetError,
    differences,
    read_json,
    shard_name,
)
from purrsight.data.text import PromptTooLongError, TextEncoder
from purrsight.datasets.builder import build_decoders, preparation_settings, source_of
from purrsight.datasets.synthetic_set import ensure_synthetic_set

log = logging.getLogger("purrsight.prepare")
MAX_LISTED_PROBLEMS = 50  # listed in full; the count says how many more there are
DEFAULT_SHARD_SIZE = 4096  # samples per shard: ~600 MB of 224-px pictures, a few seconds of work per core


@dataclass(frozen=True)
class ShardTask:
    split: str
    number: int
    index: str
    records: list[dict[str, Any]]


@dataclass(frozen=True)
class ShardResult:
    split: str
    number: int
    rows: int
    bad: list[dict[str, str]]  # {"where": "file:line (id 'x')", "error": "..."}
    written: bool


# One decoder set per worker process, built once by the pool's initializer.
_WORKER: dict[str, Any] = {}


def _init_worker(config: Config) -> None:
    import torch

    torch.set_num_threads(1)  # one core per process: the pool is the parallelism
    from purrsight.model.llm import load_tokenizer

    image, audio = build_decoders(config)
    _WORKER.update(
        config=config, image=image, audio=audio, text=TextEncoder(load_tokenizer(config.tokenizer_dir()), config.data.max_length)
    )


class _ShardRefusedError(Exception):
    """A bad sample under data.on_bad_sample=error: the shard is not published."""


def _init_pool_worker(config: Config) -> None:
    # A terminal's Ctrl-C reaches every process of the group: the parent ends the workers
    # (pool.terminate) and says so in one line, instead of each printing a KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(config)


def _prepare_shard(task: ShardTask, out: Path) -> ShardResult:
    """Decode one shard's samples and stream them into its Arrow file (64 rows in memory at a time).

    Under ``on_bad_sample: error`` a bad sample stops the writing (nothing of the shard is
    published) but not the decoding: every bad sample of the shard is listed at once.
    """
    config: Config = _WORKER["config"]
    image, audio, text = _WORKER["image"], _WORKER["audio"], _WORKER["text"]
    refuse_bad = config.data.on_bad_sample == "error"
    root = Path(task.index).parent
    bad: list[dict[str, str]] = []

    def rows() -> Iterator[dict[str, Any]]:
        for record in task.records:
            where = f"{task.index}:{record['line']} (id {record['id']!r})"
            try:
                encoded = text(record["prompt"], record["response"])
                pixels = image.stored(image.load(root / record["image"])) if image and record["image"] else None
                wave = audio.window(root / record["audio"]) if audio and record["audio"] else None
            except (SampleError, PromptTooLongError) as err:
                bad.append({"where": where, "error": str(err)})
                continue
            if not (bad and refuse_bad):  # once refused, the rest is decoded only to list its bad samples
                yield sample_row(record["id"], record["line"], encoded.input_ids, encoded.labels, pixels, wave)
        if bad and refuse_bad:
            raise _ShardRefusedError  # leaves the write: its temp file is removed, nothing is published

    name = shard_name(task.split, task.number)
    try:
        count = write_shard(out / f"{name}.arrow", rows())
    except _ShardRefusedError:
        return ShardResult(task.split, task.number, 0, bad, written=False)  # done again once the files are fixed
    write_json(out / f"{name}.json", {"rows": count, "bad": bad})  # the receipt, last: the shard is done
    return ShardResult(task.split, task.number, count, bad, written=True)


def _run_shard(args: tuple[ShardTask, Path]) -> ShardResult:
    return _prepare_shard(*args)


def parse_part(text: str) -> tuple[int, int]:
    try:
        part, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--part {text!r}: expected I/N, e.g. 0/4") from None
    if count < 1 or not 0 <= part < count:
        raise argparse.ArgumentTypeError(f"--part {text}: I must lie in 0..{count - 1}")
    return part, count


def default_processes() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parse_prepare_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="train_phase2.py prepare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Then train from it: data.prepared=DIR (in the config, or as an override). docs/DATA.md has a SLURM array example.",
    )
    parser.add_argument("--config", required=True, help="the training config (its data and model sections decide the set)")
    parser.add_argument("--out", default=None, help="prepared folder (default: data.prepared of the config)")
    parser.add_argument("--num-proc", type=int, default=None, help="decoding processes (default: the CPUs this process may use)")
    parser.add_argument("--part", type=parse_part, default=(0, 1), metavar="I/N", help="prepare part I of N (one per machine)")
    parser.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE, help="samples per shard (default: %(default)s)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, as for training")
    args = parser.parse_intermixed_args(argv)
    if args.shard_size < 1 or (args.num_proc is not None and args.num_proc < 1):
        parser.error("--shard-size and --num-proc must be positive")
    return args


def _plan(config: Config, settings: dict[str, Any], shard_size: int, records: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    data = config.data
    indexes = {"train": data.train_index, "val": data.val_index or ""}
    return {
        "format": settings["format"],
        "settings": settings,
        "sources": {split: source_of(Path(indexes[split]), len(found)) for split, found in records.items()},
        "shard_size": shard_size,
        "on_bad_sample": data.on_bad_sample,
    }


def _without_paths(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan as it is compared: a source is its content (another machine may spell its path otherwise)."""
    sources = {split: {k: v for k, v in source.items() if k != "index"} for split, source in plan.get("sources", {}).items()}
    return {**plan, "sources": sources}


def _claim_folder(out: Path, plan: dict[str, Any]) -> None:
    """Write the plan, or check that the folder's plan is this one (a continued or parallel prepare)."""
    out.mkdir(parents=True, exist_ok=True)
    for split in plan["sources"]:
        (out / split).mkdir(exist_ok=True)
    existing = out / PLAN_NAME
    if existing.is_file():
        found = read_json(existing)
        changed = differences(_without_paths(found), _without_paths(plan))
        if changed:
            raise PreparedSetError(
                f"{out} holds a prepare of other sources or settings ({', '.join(changed)} differ); "
                "use another --out, or delete the folder to start over"
            )
        return
    write_json(existing, plan)


def _tasks(config: Config, records: dict[str, list[dict[str, Any]]], shard_size: int) -> list[ShardTask]:
    indexes = {"train": config.data.train_index, "val": config.data.val_index}
    return [
        ShardTask(split, number, str(indexes[split]), found[start : start + shard_size])
        for split, found in records.items()
        for number, start in enumerate(range(0, len(found), shard_size))
    ]


def write_manifest_when_whole(out: Path, plan: dict[str, Any], tasks: list[ShardTask]) -> dict[str, Any] | None:
    """The manifest, written when every shard of every split has its receipt; None before."""
    splits: dict[str, Any] = {}
    bad_lines: list[str] = []
    for task in tasks:
        receipt_path = out / f"{shard_name(task.split, task.number)}.json"
        if not receipt_path.is_file():
            return None
        receipt = read_json(receipt_path)
        entry = splits.setdefault(task.split, {"shards": [], "samples": 0, "bad": 0})
        entry["shards"].append({"name": shard_name(task.split, task.number), "rows": receipt["rows"]})
        entry["samples"] += receipt["rows"]
        entry["bad"] += len(receipt["bad"])
        bad_lines += [json.dumps({"split": task.split, **bad}) for bad in receipt["bad"]]
    write_atomically(out / BAD_SAMPLES_NAME, "".join(f"{line}\n" for line in bad_lines).encode())
    manifest = {**plan, "splits": splits, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json(out / MANIFEST_NAME, manifest)  # last: from here on the set is complete
    return manifest


def _bad_sample_problems(config: Config, bad: list[dict[str, str]]) -> list[str]:
    lines = [f"{b['where']}: {b['error']}" for b in bad[:MAX_LISTED_PROBLEMS]]
    more = f" ({len(bad) - MAX_LISTED_PROBLEMS} more not listed)" if len(bad) > MAX_LISTED_PROBLEMS else ""
    if config.data.on_bad_sample == "error":
        hint = "fix or remove them and run prepare again (done shards are kept), or set data.on_bad_sample=skip to leave them out"
    else:
        hint = f"above data.max_bad_samples={config.data.max_bad_samples}; fix the data or raise the cap"
    return [*lines, f"{len(bad)} bad sample(s){more}: {hint}"]


def prepare_set(config: Config, out: Path, processes: int, part: tuple[int, int], shard_size: int) -> dict[str, Any] | None:
    """Prepare this part of the set into ``out``; the manifest when the set is now whole."""
    started = time.monotonic()
    ensure_synthetic_set(config)
    data = config.data
    indexes = {"train": data.train_index, **({"val": data.val_index} if data.val_index else {})}
    # Every line validated in this process first (no media file touched: they are opened when
    # decoded), all problems listed at once, before hours of decoding.
    records = {split: read_index(index, check_media=False, max_problems=MAX_LISTED_PROBLEMS) for split, index in indexes.items()}
    image, audio = build_decoders(config)
    settings = preparation_settings(config, image, audio)
    plan = _plan(config, settings, shard_size, records)
    _claim_folder(out, plan)
    tasks = _tasks(config, records, shard_size)
    index_of, count = part
    mine = [t for t in tasks if t.number % count == index_of and not (out / f"{shard_name(t.split, t.number)}.json").is_file()]
    total = sum(len(r) for r in records.values())
    log.info(
        "prepare %s: %d samples in %d shards (part %d/%d: %d shards to do, %d processes) -> %s",
        ", ".join(str(i) for i in indexes.values()),
        total,
        len(tasks),
        index_of,
        count,
        len(mine),
        processes,
        out,
    )
    bad: list[dict[str, str]] = []
    done_samples = 0
    work = [(task, out) for task in mine]
    results: Iterator[ShardResult]
    pool = None
    if processes == 1 or len(mine) <= 1:
        _init_worker(config)
        results = map(_run_shard, work)
    else:
        pool = multiprocessing.get_context("fork").Pool(processes, initializer=_init_pool_worker, initargs=(config,))
        results = pool.imap_unordered(_run_shard, work)
    try:
        for number, result in enumerate(results, start=1):
            bad += result.bad
            done_samples += result.rows + len(result.bad)
            elapsed = time.monotonic() - started
            log.info(
                "shard %d/%d done (%s %d): %d samples in %.0f s, %.0f samples/s",
                number,
                len(mine),
                result.split,
                result.number,
                done_samples,
                elapsed,
                done_samples / max(elapsed, 1e-9),
            )
    except BaseException:
        if pool is not None:
            # A worker's error or Ctrl-C: end every worker now instead of decoding the queued
            # shards first (hours on a large set). A shard cut short publishes nothing (its temp
            # file stays, hidden; done shards keep their receipts for the next prepare).
            pool.terminate()
            pool.join()
        raise
    if pool is not None:
        pool.close()
        pool.join()
    if bad and (data.on_bad_sample == "error" or len(bad) > data.max_bad_samples):
        raise PreparedSetError(problems=_bad_sample_problems(config, bad))
    manifest = write_manifest_when_whole(out, plan, tasks)
    if manifest is None:
        log.info("part %d/%d done; the set is complete once every part is (the last one writes %s)", index_of, count, MANIFEST_NAME)
    return manifest


def prepare_command(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    out = Path(args.out) if args.out else (Path(config.data.prepared) if config.data.prepared else None)
    if out is None:
        raise PreparedSetError("prepare: no output folder: pass --out DIR or set data.prepared in the config")
    try:
        manifest = prepare_set(config, out, args.num_proc or default_processes(), args.part, args.shard_size)
    except KeyboardInterrupt:
        log.warning("prepare interrupted: the shards done are kept; the same command continues from them")
        return 128 + signal.SIGINT
    if manifest is not None:
        splits = manifest["splits"].items()
        counts = ", ".join(f"{split} {entry['samples']} samples ({entry['bad']} left out)" for split, entry in splits)
        print(f"prepared set complete: {out} ({counts}); train from it with data.prepared={out}")
    return 0
