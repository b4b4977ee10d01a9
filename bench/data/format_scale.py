"""The input formats at a million rows: prepare's memory per process, and the raw path's start.

Side by side in one run, at two sizes (100,000 and 1,000,000 samples by default) of the same
samples: bench/data/data_scale.py's words and 32-px JPEGs cut from matplotlib's photograph (16
distinct files), a LLaVA conversation each with ``<image>\\n`` in front of the prompt.

1. **prepare's memory** (``train_phase2.py prepare``, the shipped real config's data settings with
   SigLIP-base's 224-px processor, 2 decoding processes, shards of 4,096): the main process,
   whose survey reads every record (text only), and the largest decoding process; peak
   anonymous memory sampled every 0.1 s (bench/data/prepare_memory.py). Formats: our JSONL, LLaVA
   JSONL, the LLaVA JSON array (streamed), and Parquet (files of 100,000 rows, row groups of 100 as
   ``datasets`` writes image sets, the JPEG's bytes in an ``image`` {bytes, path} struct, turns
   in a ``conversations`` column). Decoding a million pictures takes hours on 2 cores, so each
   run prepares ``--part 0/N`` with N chosen for ``--decode-shards`` shards at every size: the
   survey still reads all rows, the workers decode the same amount.
2. **The raw path's start**: rank 0's work before the first step on a raw index (what
   purrsight/datasets/builder.py's scanned_index does: read_index, the prompt-length check,
   then the RecordTable every rank holds), in a fresh process: seconds of each stage and the
   process's peak RSS, LLaVA JSONL against our JSONL of the same samples. Not included: the
   hand-over of the records to the other ranks, and the model's start (bench/data/data_scale.py
   measured the whole first step for our JSONL at 1M lines).

    .venv/bin/python -m bench.data.format_scale --work /tmp/format-scale      # ~16 min on 2 cores
    .venv/bin/python -m bench.data.format_scale --rows 2000 20000 --formats llava-jsonl   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.common import (
    PYTHON,
    REPO,
    TINY_CONFIG,
    bench_env,
    data_overrides,
    machine,
    prepare_overrides,
    run_prepare,
    status_mib,
    synthetic_tokenizer,
    write_index,
)

DISTINCT = 16  # pictures behind the rows
SHARD_SIZE = 4096  # prepare's default
PARQUET_FILE_ROWS = 100_000
PARQUET_ROW_GROUP = 100  # datasets' row group for image sets (config.PARQUET_ROW_GROUP_SIZE_FOR_IMAGE_DATASETS)
PREPARE_FORMATS = ("ours", "llava-jsonl", "llava-json", "parquet")


def llava_records(rows: int) -> Iterator[dict[str, Any]]:
    """write_index()'s samples as LLaVA writes them: the placeholder in front of the user's turn."""
    colours = ("red", "green", "blue", "yellow")
    for i in range(rows):
        yield {
            "id": f"s{i}",
            "image": f"images/{i % DISTINCT}.jpg",
            "conversations": [
                {"from": "human", "value": "<image>\nWhat colour is the cat?"},
                {"from": "gpt", "value": f"The cat is {colours[i % 4]}."},
            ],
        }


def write_llava(folder: Path, rows: int, array: bool) -> Path:
    """LLaVA JSONL, or a top-level JSON array (one element a line, as json.dump(indent=None) splits none)."""
    path = folder / f"llava-{rows}.{'json' if array else 'jsonl'}"
    with path.open("w") as out:
        out.write("[\n" if array else "")
        for i, record in enumerate(llava_records(rows)):
            out.write(("," if array and i else "") + json.dumps(record) + "\n")
        out.write("]\n" if array else "")
    return path


def write_parquet(folder: Path, rows: int) -> str:
    """Parquet files of PARQUET_FILE_ROWS rows (the Hub's layout: image as {bytes, path}); their glob."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = folder / f"parquet-{rows}"
    shards.mkdir(parents=True, exist_ok=True)
    pictures = [(folder / "images" / f"{k}.jpg").read_bytes() for k in range(DISTINCT)]
    turn = pa.struct([("from", pa.string()), ("value", pa.string())])
    media = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("id", pa.string()), ("image", media), ("conversations", pa.list_(turn))])
    records = llava_records(rows)
    for number in range(math.ceil(rows / PARQUET_FILE_ROWS)):
        # no dictionary: 16 distinct pictures would shrink to 16 values, where a real set's are all different
        with pq.ParquetWriter(shards / f"train-{number:05d}.parquet", schema, use_dictionary=False) as writer:
            for _ in range(0, min(PARQUET_FILE_ROWS, rows - number * PARQUET_FILE_ROWS), 10_000):
                batch = []
                for record in (next(records, None) for _ in range(10_000)):
                    if record is None:
                        break
                    k = int(record["image"].split("/")[1].split(".")[0])
                    batch.append({**record, "image": {"bytes": pictures[k], "path": f"{k}.jpg"}})
                writer.write_table(pa.Table.from_pylist(batch, schema=schema), row_group_size=PARQUET_ROW_GROUP)
    return str(shards / "*.parquet")


def shard_count(fmt: str, rows: int) -> int:
    """prepare's shards for ``rows`` samples: a shard holds one file's samples."""
    if fmt == "parquet":
        full, rest = divmod(rows, PARQUET_FILE_ROWS)
        return full * math.ceil(PARQUET_FILE_ROWS / SHARD_SIZE) + math.ceil(rest / SHARD_SIZE)
    return math.ceil(rows / SHARD_SIZE)


def raw_start(index: Path, tokenizer: Path) -> dict[str, float]:
    """Rank 0's checks of a raw index in this process (builder.scanned_index, stage by stage), then its RecordTable."""
    from purrsight.config import load_config
    from purrsight.data.dataset import check_prompt_lengths
    from purrsight.data.index import RecordTable, read_index
    from purrsight.data.text import TextEncoder
    from purrsight.datasets.builder import read_options
    from purrsight.model.llm import load_tokenizer

    config = load_config(TINY_CONFIG, data_overrides(index, None, tokenizer), check_paths=False)
    text = TextEncoder(load_tokenizer(config.tokenizer_dir()), config.data.max_length)
    before = status_mib("VmRSS")  # imports, config and tokenizer
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on: not the imports' passing one
    started = time.perf_counter()
    records = read_index(index, fmt=config.data.format, options=read_options(config))
    read = time.perf_counter()
    check_prompt_lengths(index, records, text.prompt_length, config.data.max_length, text.first_prompt_length)
    checked = time.perf_counter()
    table = RecordTable(records)
    built = time.perf_counter()
    return {
        "records": len(table),
        "read_s": read - started,
        "check_s": checked - read,
        "table_s": built - checked,
        "rss_before_mib": before,
        "peak_rss_mib": status_mib("VmHWM"),
    }


def raw_start_fresh(index: Path, tokenizer: Path) -> dict[str, float]:
    """raw_start() in a fresh interpreter."""
    command = [PYTHON, "-m", "bench.data.format_scale", "--raw-start", str(index), "--tokenizer", str(tokenizer)]
    done = subprocess.run(command, cwd=REPO, env=bench_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"raw start of {index} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000], help="set sizes (default: %(default)s)")
    parser.add_argument("--formats", nargs="+", default=list(PREPARE_FORMATS), choices=PREPARE_FORMATS, help="for part 1")
    parser.add_argument("--decode-shards", type=int, default=2, help="shards decoded per prepare run (default: %(default)s)")
    parser.add_argument("--skip", choices=("prepare", "raw"), default=None, help="leave out part 1 or part 2")
    parser.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one under /tmp)")
    parser.add_argument("--raw-start", type=Path, default=None, help=argparse.SUPPRESS)  # the fresh process of part 2
    parser.add_argument("--tokenizer", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_start is not None:
        print(json.dumps(raw_start(args.raw_start, args.tokenizer)))
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="format-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    print(machine(), flush=True)
    tokenizer = synthetic_tokenizer(work / "synthetic")
    files: dict[tuple[str, int], str] = {}
    for rows in args.rows:
        started = time.monotonic()
        folder = work / "corpus"
        files["ours", rows] = str(write_index(folder, rows, distinct=DISTINCT))
        files["llava-jsonl", rows] = str(write_llava(folder, rows, array=False))
        if "llava-json" in args.formats and args.skip != "prepare":
            files["llava-json", rows] = str(write_llava(folder, rows, array=True))
        if "parquet" in args.formats and args.skip != "prepare":
            files["parquet", rows] = write_parquet(folder, rows)
        print(f"wrote the {rows:,}-row sets in {time.monotonic() - started:.0f} s", flush=True)

    if args.skip != "prepare":
        overrides = prepare_overrides(work, tokenizer)
        print(f"\n1. prepare, 2 processes, shards of {SHARD_SIZE}; part 0/N decodes {args.decode_shards} shards")
        print("| format | samples | shards | --part | seconds | main process peak MiB | largest worker peak MiB |")
        print("|---|---|---|---|---|---|---|")
        for fmt in args.formats:
            for rows in args.rows:
                shards = shard_count(fmt, rows)
                part = f"0/{math.ceil(shards / args.decode_shards)}"
                extra = [f"data.train_index={files[fmt, rows]}", "--part", part]
                run = run_prepare(REPO, [*overrides, *extra], work / "out", SHARD_SIZE)
                figures = f"{run['seconds']:.0f} | {run['main_mib']:.0f} | {run['worker_mib']:.0f}"
                print(f"| {fmt} | {rows:,} | {shards} | {part} | {figures} |", flush=True)

    if args.skip != "raw":
        print("\n2. the raw path's start: rank 0's checks in a fresh process")
        print("| index | samples | read s | prompt length check s | RecordTable s | total s | RSS before MiB | peak RSS MiB |")
        print("|---|---|---|---|---|---|---|---|")
        for rows in args.rows:
            for fmt in ("ours", "llava-jsonl"):
                r = raw_start_fresh(Path(files[fmt, rows]), tokenizer)
                total = r["read_s"] + r["check_s"] + r["table_s"]
                stages = f"{r['read_s']:.1f} | {r['check_s']:.1f} | {r['table_s']:.1f} | {total:.1f}"
                print(f"| {fmt} | {rows:,} | {stages} | {r['rss_before_mib']:.0f} | {r['peak_rss_mib']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
