"""``python train_phase2.py prepare``: decode a dataset once into a prepared set (data/prepared.py).

Reads the config's indexes, validates every line (all problems listed, up to a cap), decodes
each sample the way training would (pictures to what the image tower takes, audio cut to the
window at the tower's rate, text tokenised) and writes memory-mapped Arrow shards, in
parallel over the machine's cores and, with ``--part I/N``, over machines (one part each; the
part that finishes last writes the manifest, or any later prepare does). Killed half-way, it
continues where it stopped: a shard is done when its receipt exists.

SIGTERM (a scheduler's stop) and Ctrl-C end every process within seconds, remove the shards cut
short and exit 128+N; a start removes what a killed prepare left of its part's shards. With
data.on_bad_sample=skip, the bad samples of every shard done so far, this run's, earlier runs'
and other parts', are counted against data.max_bad_samples before a manifest is written.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import re
import signal
import time
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from purrsight.atomic_file import TEMP_SUFFIX, stale_temp_files, write_atomically
from purrsight.atomic_file import write_json_atomically as write_json
from purrsight.config import Config, load_config
from purrsight.data.formats.records import DamagedFileError, ReadOptions, Record, RecordError
from purrsight.data.formats.sources import SourceError, detect, expand
from purrsight.data.formats.streams import read_records
from purrsight.data.index import MAX_LISTED_PROBLEMS, IndexFileError
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
from purrsight.data.text import PromptTooLongError, TemplateRefusedError, TextEncoder
from purrsight.datasets.builder import build_decoders, preparation_settings, read_options, source_of
from purrsight.datasets.duplicate_ids import IdHashes, duplicate_lines
from purrsight.datasets.synthetic_set import ensure_synthetic_set
from purrsight.datasets.worker_set import WorkerLostError, run_unordered
from purrsight.errors import SIGNAL_BASE

log = logging.getLogger("purrsight.prepare")
DEFAULT_SHARD_SIZE = 4096  # samples per shard: ~600 MB of 224-px pictures, a few seconds of work per core
# A shard's data or receipt half written (atomic_file.temp_name): .shard-00003.arrow.<host>.<pid>.<random>.tmp
TEMP_SHARD = re.compile(r"^\.shard-(\d+)\.(?:arrow|json)\..+" + re.escape(TEMP_SUFFIX) + "$")


@dataclass(frozen=True)
class ShardTask:
    split: str
    number: int
    index: str  # the file its samples come from (a shard holds one file's samples)
    format: str  # data/formats/sources.py FORMATS
    offset: int  # where its first sample starts: a byte offset (JSON, tar) or a Parquet row
    ordinal: int  # samples (JSONL: lines) of the file before it
    count: int


@dataclass(frozen=True)
class Survey:
    """One split's sources read once through (text only): their format, samples and shards' starts."""

    spec: str
    format: str
    records: int
    chunks: list[tuple[str, int, int, int]]  # (file, offset, ordinal, count) of each shard


@dataclass(frozen=True)
class ShardResult:
    split: str
    number: int
    rows: int
    bad: list[dict[str, str]]  # {"where": "file:line (id 'x')", "error": "..."}
    written: bool


# One decoder set per worker process, built once by its initializer (worker_set.run_unordered).
_WORKER: dict[str, Any] = {}


def _init_worker(config: Config) -> None:
    import torch

    torch.set_num_threads(1)  # one core per process: the worker processes are the parallelism
    from purrsight.model.llm import load_tokenizer

    image, audio = build_decoders(config)
    _WORKER.update(
        config=config,
        image=image,
        audio=audio,
        text=TextEncoder(load_tokenizer(config.tokenizer_dir()), config.data.max_length),
        options=read_options(config),
    )


class _ShardRefusedError(Exception):
    """A bad sample under data.on_bad_sample=error: the shard is not published."""


class PrepareStopped(BaseException):
    """SIGTERM or SIGINT arrived: raised in the main process, like KeyboardInterrupt (no ``except Exception`` takes it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _StopOnSignals:
    """SIGTERM (a scheduler's stop) and SIGINT (Ctrl-C) raise PrepareStopped in this process, once.

    A signal this process inherited as ignored stays ignored: a shell starts a background job
    with SIGINT ignored, so that the terminal's Ctrl-C is not its to take.
    """

    def __init__(self) -> None:
        self.main = os.getpid()
        self.signum: int | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.main:  # a fork that is not worker_set's (it blocks stops): end as the default does
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.signum is None:  # a second signal (SLURM signals every process) must not cut the cleanup short
            self.signum = signum
            raise PrepareStopped(signum)


@contextmanager
def stopping_on_signals() -> Iterator[None]:
    handler = _StopOnSignals()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    installed = [sig for sig, was in previous.items() if was is not signal.SIG_IGN]
    for sig in installed:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig in installed:
            signal.signal(sig, previous[sig])


def _prepare_shard(task: ShardTask, out: Path) -> ShardResult:
    """Decode one shard's samples and stream them into its Arrow file (64 rows in memory at a time).

    Under ``on_bad_sample: error`` a bad sample stops the writing (nothing of the shard is
    published) but not the decoding: every bad sample of the shard is listed at once.
    """
    config: Config = _WORKER["config"]
    image, audio, text = _WORKER["image"], _WORKER["audio"], _WORKER["text"]
    refuse_bad = config.data.on_bad_sample == "error"
    bad: list[dict[str, str]] = []

    def rows() -> Iterator[dict[str, Any]]:
        records = read_records(Path(task.index), task.format, task.offset, task.ordinal, _WORKER["options"])
        for _, record in itertools.islice(records, task.count):
            if isinstance(record, DamagedFileError):  # a cut tar's rest: one bad sample, those before it kept
                bad.append({"where": record.where, "error": record.reason})
                continue
            if isinstance(record, RecordError):  # the survey read it whole: the file changed since
                raise PreparedSetError(f"{record} (the file changed during the prepare?)")
            try:
                if record.problem is not None:  # no assistant turn, a placeholder without its media, a lone tar member
                    raise SampleError(record.problem)
                encoded = text.encode_turns(record.turns)
                pixels = image.stored(image.load(record.image)) if image and record.image else None
                wave = audio.window(record.audio) if audio and record.audio else None
            except (SampleError, PromptTooLongError, TemplateRefusedError) as err:
                bad.append({"where": record.where, "error": str(err)})
                continue
            if not (bad and refuse_bad):  # once refused, the rest is decoded only to list its bad samples
                yield sample_row(record.id, record.line, encoded.input_ids, encoded.labels, pixels, wave, encoded.media_at)
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


def survey(spec: str, config: Config, options: ReadOptions, shard_size: int) -> Survey:
    """Read every record of ``spec``'s files once, text only (no media byte is read or decoded): count
    them, mark where each shard starts and list what cannot be read (up to MAX_LISTED_PROBLEMS, each
    FILE:LINE). Memory: one entry per shard, and 8 bytes per line of our JSONL for the duplicate-id
    check (duplicate_ids.py), whatever the set's size."""
    try:
        files = expand(spec)
        fmt = detect(files, config.data.format, options.fields)
    except SourceError as err:
        raise IndexFileError(str(err)) from None
    problems: list[str] = []
    chunks: list[tuple[str, int, int, int]] = []
    total = 0
    for path in files:
        ids = IdHashes() if fmt == "purrsight" else None  # our JSONL's ids are unique per file
        current: list[Any] | None = None
        try:
            for offset, record in read_records(path, fmt, options=options, load_media=False):
                if isinstance(record, RecordError) and not isinstance(record, DamagedFileError):
                    problems.append(str(record))
                else:  # a record, or a damaged file's rest: a bad sample its shard's worker names
                    if ids is not None and isinstance(record, Record):
                        ids.add(record.id)
                    total += 1
                    before = record.ordinal if isinstance(record, DamagedFileError) else record.line - 1
                    current = current or [str(path), offset, before, 0]
                    current[3] += 1
                    if current[3] == shard_size:
                        chunks.append((current[0], current[1], current[2], current[3]))
                        current = None
                    continue
                if len(problems) >= MAX_LISTED_PROBLEMS:
                    break
        except RecordError as err:  # nothing after it can be read (an unclosed JSON array, a broken tar)
            problems.append(str(err))
        if current is not None:
            chunks.append((current[0], current[1], current[2], current[3]))
        suspects = ids.suspects() if ids is not None and len(problems) < MAX_LISTED_PROBLEMS else set()
        if suspects:  # a second read, of the suspects' ids only; listed after the file's unreadable lines
            again = read_records(path, fmt, options=options, load_media=False)
            records = ((r.id, r.line) for _, r in again if not isinstance(r, RecordError))
            try:
                for sample_id, line, first in duplicate_lines(records, suspects):
                    problems.append(f"{path}:{line}: duplicate id {sample_id!r} (first on line {first})")
                    if len(problems) >= MAX_LISTED_PROBLEMS:
                        break  # the generator stops, and the second read with it
            except RecordError:
                pass  # where the first read stopped, listed by it
        if len(problems) >= MAX_LISTED_PROBLEMS:
            break
    if problems:
        more = f" (the first {MAX_LISTED_PROBLEMS}; the scan stopped there)" if len(problems) >= MAX_LISTED_PROBLEMS else ""
        raise IndexFileError(problems=[*problems, f"{spec}: {len(problems)} bad line(s){more}"])
    if total == 0:
        raise IndexFileError(f"{spec}: index holds no samples")
    return Survey(spec, fmt, total, chunks)


def _plan(settings: dict[str, Any], shard_size: int, surveys: dict[str, Survey], on_bad_sample: str) -> dict[str, Any]:
    return {
        "format": settings["format"],
        "settings": settings,
        "sources": {split: source_of(found.spec, found.format, found.records) for split, found in surveys.items()},
        "shard_size": shard_size,
        "on_bad_sample": on_bad_sample,
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
        # The refusal's own advice, followed into the same folder: shards published under "error"
        # hold no bad sample, so they stand under "skip" too (the other way, shards that left bad
        # samples out would not stand, and the plans differ).
        relaxed = found.get("on_bad_sample") == "error" and plan["on_bad_sample"] == "skip"
        changed = differences(
            _without_paths({**found, "on_bad_sample": plan["on_bad_sample"]} if relaxed else found), _without_paths(plan)
        )
        if changed:
            raise PreparedSetError(
                f"{out} holds a prepare of other sources or settings ({', '.join(changed)} differ); "
                "use another --out, or delete the folder to start over"
            )
        if not relaxed:
            return
    write_json(existing, plan)


def _tasks(surveys: dict[str, Survey]) -> list[ShardTask]:
    return [
        ShardTask(split, number, path, found.format, offset, ordinal, count)
        for split, found in surveys.items()
        for number, (path, offset, ordinal, count) in enumerate(found.chunks)
    ]


def remove_temp_shards(out: Path, tasks: list[ShardTask]) -> list[Path]:
    """Remove the half-written files (data or receipt) of ``tasks``' shards; the paths removed.

    Only these shards': with --part, other machines may be writing their own into the same folder.
    """
    shards = {(task.split, task.number) for task in tasks}
    removed = []
    for split in sorted({task.split for task in tasks}):
        for path in stale_temp_files(out / split):
            match = TEMP_SHARD.match(path.name)
            if match and (split, int(match.group(1))) in shards:
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


Receipts = dict[str, dict[str, Any]]  # shard name (shard_name) -> its receipt


def _receipts(out: Path, tasks: list[ShardTask]) -> Receipts:
    """The receipts of the shards done so far (by this run, earlier runs or other parts)."""
    paths = {shard_name(task.split, task.number): out / f"{shard_name(task.split, task.number)}.json" for task in tasks}
    return {name: read_json(path) for name, path in paths.items() if path.is_file()}


def check_bad_sample_cap(config: Config, receipts: Receipts) -> None:
    """PreparedSetError when the shards done so far left out more samples than data.max_bad_samples.

    Over the whole set, not one run's shards: a rerun (whose done shards are not redone) or a
    part each under the cap must not publish a set over it. The count only grows, so a part
    that finds it over refuses at once, the set whole or not.
    """
    bad = [entry for receipt in receipts.values() for entry in receipt["bad"]]
    if len(bad) <= config.data.max_bad_samples:
        return
    left_out = sorted(f"{name}.json" for name, receipt in receipts.items() if receipt["bad"])
    named = ", ".join(left_out[:5]) + (f" and {len(left_out) - 5} more" if len(left_out) > 5 else "")
    hint = (
        f"above data.max_bad_samples={config.data.max_bad_samples} across the set; raise the cap, or fix the files "
        f"and delete the receipts of the shards that left them out ({named}) so that prepare does those again"
    )
    raise PreparedSetError(problems=_bad_sample_problems(bad, hint))


def write_manifest_when_whole(out: Path, plan: dict[str, Any], tasks: list[ShardTask], receipts: Receipts) -> dict[str, Any] | None:
    """The manifest, written when every shard of every split has its receipt; None before."""
    if len(receipts) < len(tasks):
        return None
    splits: dict[str, Any] = {}
    bad_lines: list[str] = []
    for task in tasks:
        receipt = receipts[shard_name(task.split, task.number)]
        entry = splits.setdefault(task.split, {"shards": [], "samples": 0, "bad": 0})
        entry["shards"].append({"name": shard_name(task.split, task.number), "rows": receipt["rows"]})
        entry["samples"] += receipt["rows"]
        entry["bad"] += len(receipt["bad"])
        bad_lines += [json.dumps({"split": task.split, **bad}) for bad in receipt["bad"]]
    write_atomically(out / BAD_SAMPLES_NAME, "".join(f"{line}\n" for line in bad_lines).encode())
    manifest = {**plan, "splits": splits, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_json(out / MANIFEST_NAME, manifest)  # last: from here on the set is complete
    return manifest


def _bad_sample_problems(bad: list[dict[str, str]], hint: str) -> list[str]:
    lines = [f"{b['where']}: {b['error']}" for b in bad[:MAX_LISTED_PROBLEMS]]
    more = f" ({len(bad) - MAX_LISTED_PROBLEMS} more not listed)" if len(bad) > MAX_LISTED_PROBLEMS else ""
    return [*lines, f"{len(bad)} bad sample(s){more}: {hint}"]


REFUSED_HINT = "fix or remove them and run prepare again (done shards are kept), or set data.on_bad_sample=skip to leave them out"


def prepare_set(config: Config, out: Path, processes: int, part: tuple[int, int], shard_size: int) -> dict[str, Any] | None:
    """Prepare this part of the set into ``out``; the manifest when the set is now whole."""
    started = time.monotonic()
    ensure_synthetic_set(config)
    data = config.data
    indexes = {"train": data.train_index, **({"val": data.val_index} if data.val_index else {})}
    # Every record read in this process first (no media file touched: they are opened when
    # decoded), all problems listed at once, before hours of decoding.
    options = read_options(config)
    surveys = {split: survey(index, config, options, shard_size) for split, index in indexes.items()}
    image, audio = build_decoders(config)
    settings = preparation_settings(config, image, audio)
    plan = _plan(settings, shard_size, surveys, data.on_bad_sample)
    _claim_folder(out, plan)
    tasks = _tasks(surveys)
    index_of, count = part
    ours = [t for t in tasks if t.number % count == index_of]
    removed = remove_temp_shards(out, ours)
    if removed:
        log.warning("removed %d half-written shard file(s) left by an interrupted prepare (%s, ...)", len(removed), removed[0])
    mine = [t for t in ours if not (out / f"{shard_name(t.split, t.number)}.json").is_file()]
    total = sum(found.records for found in surveys.values())
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
    bad = _decode_shards(config, out, mine, processes, started)
    if bad and data.on_bad_sample == "error":
        raise PreparedSetError(problems=_bad_sample_problems(bad, REFUSED_HINT))
    receipts = _receipts(out, tasks)
    check_bad_sample_cap(config, receipts)
    manifest = write_manifest_when_whole(out, plan, tasks, receipts)
    if manifest is None:
        log.info("part %d/%d done; the set is complete once every part is (the last one writes %s)", index_of, count, MANIFEST_NAME)
    return manifest


def _decode_shards(config: Config, out: Path, mine: list[ShardTask], processes: int, started: float) -> list[dict[str, str]]:
    """Decode and write ``mine``, in ``processes`` processes; the bad samples found.

    A stop (PrepareStopped, KeyboardInterrupt) or a worker's error ends every worker now instead
    of decoding the queued shards first (hours on a large set), and removes the shards they cut
    short; done shards keep their receipts for the next prepare.
    """
    work = [(task, out) for task in mine]
    results: Iterator[ShardResult]
    if processes == 1 or len(mine) <= 1:
        _init_worker(config)
        results = map(_run_shard, work)
    else:
        results = run_unordered(_run_shard, work, min(processes, len(mine)), _init_worker, (config,), _shard_of)
    try:
        bad = _follow(results, len(mine), started)
    except BaseException:
        if isinstance(results, Generator):
            results.close()  # every worker ended now (SIGTERM: a worker's shard cut short mid-write)
        removed = remove_temp_shards(out, mine)
        if removed:
            log.info("removed %d half-written shard file(s) of the shards cut short", len(removed))
        raise
    return bad


def _shard_of(work: tuple[ShardTask, Path]) -> str:
    task = work[0]
    return f"shard {task.number} ({task.split}, from {task.index})"


def _follow(results: Iterator[ShardResult], shards: int, started: float) -> list[dict[str, str]]:
    """Log each shard as it is done; the bad samples of all."""
    bad: list[dict[str, str]] = []
    done_samples = 0
    for number, result in enumerate(results, start=1):
        bad += result.bad
        done_samples += result.rows + len(result.bad)
        elapsed = time.monotonic() - started
        log.info(
            "shard %d/%d done (%s %d): %d samples in %.0f s, %.0f samples/s",
            number,
            shards,
            result.split,
            result.number,
            done_samples,
            elapsed,
            done_samples / max(elapsed, 1e-9),
        )
    return bad


def prepare_command(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    out = Path(args.out) if args.out else (Path(config.data.prepared) if config.data.prepared else None)
    if out is None:
        raise PreparedSetError("prepare: no output folder: pass --out DIR or set data.prepared in the config")
    try:
        with stopping_on_signals():
            manifest = prepare_set(config, out, args.num_proc or default_processes(), args.part, args.shard_size)
    except (PrepareStopped, KeyboardInterrupt) as stop:
        signum = stop.signum if isinstance(stop, PrepareStopped) else signal.SIGINT
        name = signal.Signals(signum).name
        log.warning("prepare interrupted by %s: the shards done are kept; the same command continues from them", name)
        return SIGNAL_BASE + signum
    except WorkerLostError as lost:  # not the input's fault, and its traceback would say nothing more
        log.error("prepare stopped: %s; the shards done are kept, the same command continues from them", lost)
        return 1
    if manifest is not None:
        splits = manifest["splits"].items()
        counts = ", ".join(f"{split} {entry['samples']} samples ({entry['bad']} left out)" for split, entry in splits)
        print(f"prepared set complete: {out} ({counts}); train from it with data.prepared={out}")
    return 0
