"""Each input format trained on real ranks (torchrun, gloo) and resumed on another world size, every
sample once per epoch: WebDataset tars and Parquet shards through `prepare`, LLaVA and messages files
directly, their placeholders in front of, inside and after the prompt (the model places the media
there: batches carry ``media_at``).

The two JSON formats share one run: a raw index is read whole into records before any step (rank
0's scan, the records broadcast), and from the records on nothing knows the format. The LLaVA file
must read to the same records as the messages file, field by field, line numbers included (what an
error names), and the messages file trains: the LLaVA run was the same run twice. The two sharded
formats do not share one: their prepared sets split into different shards (a shard per source
file's part), so each resumes across its own shard edges.

47 samples of the synthetic set (tests/format_sets.py writes them with tarfile, pyarrow.parquet,
json). 2 ranks x 3 samples: 7 micro-batches an epoch, 5 samples left out; the step-4 checkpoint
(24 samples of epoch 0 trained) resumes on 3 ranks x 2 to step 14: epoch 0's last 3 steps (5 left
out), then epoch 1 whole (7 micro-batches, 5 left out). Numbers that do not divide, on purpose.

No loader workers: what reaches them is a prepared set or records, whatever the format was (a
resume with workers is tests/integration/test_prepared_training.py's).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from purrsight.data.index import read_index
from purrsight.datasets.prepare_job import prepare_set
from tests.format_sets import items_of, write_llava, write_messages, write_parquet, write_tars
from tests.helpers import tiny_config, tiny_overrides
from tests.integration.test_prepared_training import run_probe

SAMPLES = 47


@pytest.mark.parametrize("fmt", ["webdataset", "parquet", "llava and messages"])
def test_each_format_trains_on_two_ranks_and_resumes_on_three_with_every_sample_once_per_epoch(
    fmt: str, synthetic_dir: Path, tmp_path: Path
) -> None:
    items = items_of(synthetic_dir, SAMPLES)
    data = tmp_path / "data"
    data.mkdir()
    index = {
        "webdataset": lambda: write_tars(data, items, per_shard=10),
        "parquet": lambda: write_parquet(data, items, per_file=20, row_group=7),
        "llava and messages": lambda: str(write_messages(data, items, where="varied")),
    }[fmt]()
    if fmt == "llava and messages":
        llava = read_index(str(write_llava(data, items, where="varied")))
        assert llava == read_index(index), "the LLaVA file read to other records than the messages file"
        assert [record["id"] for record in llava] == [item.id for item in items]
    extra: dict[str, object] = {"data__train_index": index, "data__val_index": "null"}
    if fmt in ("webdataset", "parquet"):  # shards train from a prepared set; JSON files train raw, as our JSONL does
        config = tiny_config(synthetic_dir, tmp_path, **extra)
        assert prepare_set(config, tmp_path / "set", processes=2, part=(0, 1), shard_size=8) is not None
        extra["data__prepared"] = tmp_path / "set"

    def overrides(batch: int, steps: int) -> list[str]:
        return tiny_overrides(
            synthetic_dir, tmp_path / "run", data__batch_size=batch, trainer__max_steps=steps, trainer__val_every_n_steps=1000,
            checkpoint__every_n_steps=4, checkpoint__keep_last=10, data__num_workers=0, run__deterministic="true", **extra,
        )  # fmt: skip

    _, two = run_probe(2, tmp_path / "run", overrides(3, 4))
    checkpoint = tmp_path / "run" / "phase2-tiny" / "checkpoints" / "step-00000004.ckpt"
    _, three = run_probe(3, tmp_path / "run", overrides(2, 14), resume=str(checkpoint))

    every = {item.id for item in items}
    for epoch, runs in ((0, two + three), (1, three)):
        taken = [sample for probe in runs for seen_epoch, ids in probe["seen"] for sample in ids if seen_epoch == epoch]
        twice = [sample for sample, count in Counter(taken).items() if count > 1]
        assert not twice, f"{fmt}: trained twice in epoch {epoch}: {twice}"
        assert set(taken) <= every
        assert len(every - set(taken)) == 5, f"{fmt}: left out of epoch {epoch}: {sorted(every - set(taken))}"
