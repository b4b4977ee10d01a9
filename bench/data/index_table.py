"""The raw index in memory: our RecordTable (plain pyarrow) against `datasets.Dataset.from_list`.

Side by side in one run, on the same records (a million by default, the shape read_index()
returns): the time to build the table, the time to read one record at a random position
(what the dataset does per sample), and a first one-record table in a fresh interpreter: the
imports it takes, pyarrow's own import of pandas on its first conversion from Python objects
included (every trainer process that trains from a raw index pays it once).

    .venv/bin/python -m bench.data.index_table --records 1000000   # from the repository root
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.common import machine
from purrsight.data.index import MEDIA_FIELDS, REQUIRED_TEXT_FIELDS, RecordTable


def records(count: int) -> list[dict[str, Any]]:
    prompt = "What colour is the cat on the left of the picture?"
    return [
        {"id": f"s{i:07d}", "prompt": prompt, "response": "Red.", "image": f"images/{i % 1000}.jpg", "audio": None, "line": i + 1}
        | {"turns": None, "problem": None}  # a conversation's turns, a record's problem: none here
        for i in range(count)
    ]


def from_datasets(rows: list[dict[str, Any]]) -> Any:
    import datasets

    features = {field: datasets.Value("string") for field in (*REQUIRED_TEXT_FIELDS, *MEDIA_FIELDS)}
    extra = {"line": datasets.Value("int32"), "turns": datasets.Value("string"), "problem": datasets.Value("string")}
    return datasets.Dataset.from_list(rows, features=datasets.Features({**features, **extra}))


def first_table_seconds(build: str, repeats: int) -> float:
    """A fresh interpreter's first one-record table from ``build``, imports included (both builders import lazily)."""
    code = "import time, bench.data.index_table as b; t = time.perf_counter(); "
    code += f"b.{build}(b.records(1)); print(time.perf_counter() - t)"
    command = [sys.executable, "-c", code]
    runs = [subprocess.run(command, capture_output=True, text=True, check=True).stdout for _ in range(repeats)]
    return statistics.median(float(seconds) for seconds in runs)


def read_us(table: Any, positions: list[int]) -> float:
    start = time.perf_counter()
    for i in positions:
        table[i]
    return (time.perf_counter() - start) / len(positions) * 1e6


def timed(build: Callable[[list[dict[str, Any]]], Any], rows: list[dict[str, Any]]) -> tuple[Any, float]:
    start = time.perf_counter()
    table = build(rows)
    return table, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--reads", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3, help="fresh interpreters per first-table timing")
    args = parser.parse_args()
    print(machine())
    rows = records(args.records)
    positions = [random.randrange(args.records) for _ in range(args.reads)]
    print(f"{args.records:,} records; {args.reads:,} reads at random positions; first table: median of {args.repeats}")
    print(f"{'':24s} {'build s':>8s} {'read us':>8s} {'first table s':>14s}")
    ours, ours_s = timed(RecordTable, rows)
    theirs, theirs_s = timed(from_datasets, rows)
    mine = {key: value for key, value in ours[positions[0]].items() if key != "chars"}  # conversations' column: null here
    assert mine == theirs[positions[0]]  # the same record either way
    contenders = (("RecordTable (pyarrow)", ours, ours_s, "RecordTable"), ("datasets.from_list", theirs, theirs_s, "from_datasets"))
    for name, table, built, builder in contenders:
        first = first_table_seconds(builder, args.repeats)
        print(f"{name:24s} {built:8.2f} {read_us(table, positions):8.1f} {first:14.2f}")


if __name__ == "__main__":
    main()
