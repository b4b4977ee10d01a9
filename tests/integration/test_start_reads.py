"""Under fsdp a rank reads its share of the base at start, and little else (issue 44, part 2).

Two real ranks (torchrun, gloo) build the tiny default's model with its LLM from a 55 MB bf16
folder in three files, through the trainer's sharded build, each rank from its own copy (a page
cache of its own, as on separate nodes; bench/model/start_reads.py says why). A rank may read its rows
of each tensor plus 5% of the base: the fingerprint's fixed sample (rank 0 alone), the files'
headers, the tokenizer. Before version 3 of the fingerprint each rank sampled every tensor by
strided rows, and read its rows through a memory map whose read-ahead pulled in its neighbours'
(bench/results/model.md: the whole base on each rank). The 0.5B shape's figures are bench/results/model.md's.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.model.start_reads import measure, on_tmpfs, prepare
from tests.helpers import REPO

ALLOWANCE = 0.05  # of the base, beyond the rank's shard


@pytest.fixture
def on_disk(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path``, or where that is a tmpfs (whose reads count no storage) a folder in the repository's runs/."""
    if not on_tmpfs(tmp_path):
        yield tmp_path
        return
    (REPO / "runs").mkdir(exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=REPO / "runs"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder)


def test_each_rank_reads_its_shard_of_the_base_and_at_most_5_percent_more(on_disk: Path) -> None:
    root, synthetic = prepare(on_disk, "small", ranks=2)
    rows = measure(root, synthetic, ranks=2)
    assert [row["rank"] for row in rows] == [0, 1]
    assert len({row["fingerprint"] for row in rows}) == 1
    assert [row["sample_digests"] for row in rows] == [1, 0]  # rank 0 reads the fingerprint's sample and broadcasts it
    for row in rows:
        assert row["read"] >= 0.9 * row["shard"], f"reads went uncounted ({row}): /proc/self/io sees no storage here"
        extra = (row["read"] - row["shard"]) / row["base"]
        assert extra <= ALLOWANCE, f"rank {row['rank']} read {100 * extra:.1f}% of the base beyond its shard: {row}"
