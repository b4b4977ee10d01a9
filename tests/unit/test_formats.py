"""The input formats (purrsight/data/formats): LLaVA, messages, WebDataset tars and Parquet shards read
through one interface, prepared into the same rows as our JSONL, multi-turn labels, bad records.

Sets are written in the tests with the formats' own libraries (tests/format_sets.py: json, tarfile,
pyarrow.parquet); the media are real files from public packages (matplotlib's photograph and
icon, Debian alsa-utils' speech), as tests/unit/test_real_media.py uses them.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import matplotlib.cbook
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from purrsight.data.formats.json_values import iter_values
from purrsight.data.formats.records import ReadOptions, Record
from purrsight.data.formats.sources import expand, expand_braces
from purrsight.data.formats.streams import read_records
from purrsight.data.index import IndexFileError, read_index
from purrsight.data.prepared_manifest import BAD_SAMPLES_NAME, PreparedSetError
from purrsight.data.text import TextEncoder
from purrsight.datasets.prepare_job import prepare_set, survey
from purrsight.labels import IGNORE_INDEX
from purrsight.model.llm import load_tokenizer
from tests.format_sets import Item, add_member, marked, write_llava, write_messages, write_ours, write_parquet, write_tars
from tests.helpers import DEFAULT_CONFIG, REPO, python_env, tiny_config, tiny_overrides

PHOTO = Path(matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))
ICON = Path(matplotlib.cbook.get_sample_data("Minduka_Present_Blue_Pack.png", asfileobj=False))
SPEECH = Path("/usr/share/sounds/alsa/Front_Center.wav")
CAPTION_PROMPT = "Describe this."  # data.caption_prompt's default


def real_items(count: int) -> list[Item]:
    """Samples over the real media: picture only, audio only, both, caption-only."""
    if not SPEECH.is_file():
        pytest.skip("needs /usr/share/sounds/alsa: apt-get install alsa-utils (scripts/test.sh does)")
    items = []
    for n in range(count):
        kind = n % 4
        image = (PHOTO if n % 2 else ICON) if kind in (0, 2, 3) else None
        audio = SPEECH if kind in (1, 2) else None
        if kind == 3:
            items.append(Item(f"s{n:03d}", CAPTION_PROMPT, f"caption number {n}", image, None, caption_only=True))
        else:
            items.append(Item(f"s{n:03d}", f"what is in sample {n}?", f"answer {n} is here", image, audio))
    return items


def write_format(fmt: str, folder: Path, items: list[Item]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "purrsight":
        return str(write_ours(folder, items))
    if fmt == "llava":
        return str(write_llava(folder, items))
    if fmt == "messages":
        return str(write_messages(folder, items))
    if fmt == "webdataset":
        return write_tars(folder, items, per_shard=4)
    return write_parquet(folder, items, per_file=5, row_group=2)


def prepared_rows(folder: Path) -> dict[str, dict[str, Any]]:
    rows = {}
    for shard in sorted((folder / "train").glob("shard-*.arrow")):
        with pa.memory_map(str(shard), "r") as source:
            for row in pa.ipc.open_stream(source).read_all().to_pylist():
                rows[row.pop("id")] = {k: v for k, v in row.items() if k != "line"}
    return rows


@pytest.fixture(scope="module")
def ours_prepared(synthetic_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("ours")
    index = write_format("purrsight", root, real_items(11))
    config = tiny_config(synthetic_dir, root, data__train_index=index, data__val_index="null")
    assert prepare_set(config, root / "set", processes=1, part=(0, 1), shard_size=3) is not None
    return prepared_rows(root / "set")


@pytest.mark.parametrize("fmt", ["llava", "messages", "webdataset", "parquet"])
def test_each_format_prepares_into_the_rows_our_jsonl_gives(
    fmt: str, synthetic_dir: Path, ours_prepared: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """The same 11 samples (pictures, speech, both, captions) in each format: detected from the files,
    streamed (tars and Parquet never unpacked: no file is written but the shards), and prepared into
    exactly our JSONL's tokens, labels, pixels and audio."""
    index = write_format(fmt, tmp_path / "data", real_items(11))
    before = set(tmp_path.rglob("*"))
    config = tiny_config(synthetic_dir, tmp_path, data__train_index=index, data__val_index="null")
    manifest = prepare_set(config, tmp_path / "set", processes=1, part=(0, 1), shard_size=3)
    assert manifest is not None and manifest["sources"]["train"]["format"] == fmt
    written = {p for p in set(tmp_path.rglob("*")) - before if not p.is_relative_to(tmp_path / "set")}
    assert written == set(), f"files unpacked outside the prepared set: {sorted(written)}"
    rows = prepared_rows(tmp_path / "set")
    at_columns = ("image_at", "audio_at")
    assert {i: {k: v for k, v in row.items() if k not in at_columns} for i, row in rows.items()} == {
        i: {k: v for k, v in row.items() if k not in at_columns} for i, row in ours_prepared.items()
    }
    # LLaVA and messages put "<image>\n<audio>\n" before the prompt: the media go right after <bos>,
    # where the placeholders stood; tars and Parquet have no text to place them in: in front.
    placed = 1 if fmt in ("llava", "messages") else None
    for i, row in rows.items():
        for column in at_columns:
            assert row[column] == (placed if ours_prepared[i][column.removesuffix("_at")] is not None else None), (i, column)


def test_a_multi_turn_conversation_trains_on_its_assistant_turns_only(synthetic_dir: Path) -> None:
    """Ours (no chat template): <bos> user answer <eos> user answer <eos>; only the answers and their
    <eos> carry labels; a cut at max_length keeps the head; one user and one assistant turn give
    exactly the single-turn encoding."""
    tokenizer = load_tokenizer(synthetic_dir / "tokenizer")
    text = TextEncoder(tokenizer, 200)
    turns = [("system", "be brief"), ("user", "what colour is the cat"), ("assistant", "red"),
             ("user", "and the sound"), ("assistant", "a low tone")]  # fmt: skip
    encoded = text.encode_turns(turns)
    trained = [tok for tok, label in zip(encoded.input_ids, encoded.labels, strict=True) if label != IGNORE_INDEX]
    assert tokenizer.decode(trained, skip_special_tokens=True).split() == ["red", "a", "low", "tone"]
    assert trained.count(tokenizer.eos_token_id) == 2
    assert text.encode_turns(turns[1:3]) == text("what colour is the cat", "red")
    first = next(i for i, label in enumerate(encoded.labels) if label != IGNORE_INDEX)
    cut = TextEncoder(tokenizer, first + 2).encode_turns(turns)
    assert cut.input_ids == encoded.input_ids[: first + 2] and cut.labels == encoded.labels[: first + 2]
    with pytest.raises(ValueError, match="no room for the response"):
        TextEncoder(tokenizer, first).encode_turns(turns)


def test_with_a_chat_template_every_assistant_turn_and_nothing_else_is_labelled(synthetic_dir: Path) -> None:
    tokenizer = load_tokenizer(synthetic_dir / "tokenizer")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    text = TextEncoder(tokenizer, 400)
    turns = [("user", "what colour is the cat"), ("assistant", "red"), ("user", "and the tone"), ("assistant", "low")]
    encoded = text.encode_turns(turns)
    rendered = tokenizer.apply_chat_template([{"role": r, "content": t} for r, t in turns], tokenize=True, return_dict=False)
    assert encoded.input_ids == list(rendered)
    trained = tokenizer.decode([t for t, lab in zip(encoded.input_ids, encoded.labels, strict=True) if lab != IGNORE_INDEX])
    assert "red" in trained and "low" in trained and "cat" not in trained and "tone" not in trained


def bad_set(folder: Path) -> tuple[str, str]:
    """A tar and a LLaVA file with one of each bad record among good ones; (tar pattern, llava path)."""
    import tarfile

    folder.mkdir()
    with tarfile.open(folder / "00000.tar", "w") as tar:
        add_member(tar, "good1.jpg", PHOTO.read_bytes())
        add_member(tar, "good1.txt", b"a woman in uniform")
        add_member(tar, "lonely.jpg", ICON.read_bytes())  # a picture without its caption
        add_member(tar, "textonly.txt", b"a caption without its picture")
        add_member(tar, "broken.jpg", PHOTO.read_bytes()[:2000])  # undecodable
        add_member(tar, "broken.txt", b"cut short")
        add_member(tar, "good2.png", ICON.read_bytes())
        add_member(tar, "good2.txt", b"a blue present")

    def conversation(*turns: str) -> list[dict[str, str]]:
        return [{"from": "human" if n % 2 == 0 else "gpt", "value": text} for n, text in enumerate(turns)]

    llava = [
        {"id": "fine", "image": str(PHOTO), "conversations": conversation("<image>\nwho", "her")},
        {"id": "noanswer", "image": str(PHOTO), "conversations": conversation("<image>\nwho")},
        {"id": "nomedia", "conversations": conversation("<image>\nwho", "x")},
        {"id": "missing", "image": str(folder / "gone.jpg"), "conversations": conversation("q", "a")},
        {"id": "fine2", "conversations": conversation("hi", "hello")},
    ]
    (folder / "llava.json").write_text(json.dumps(llava))
    return str(folder / "{00000..00000}.tar"), str(folder / "llava.json")


def test_bad_records_get_one_line_each_under_the_bad_sample_cap(synthetic_dir: Path, tmp_path: Path) -> None:
    tars, llava = bad_set(tmp_path / "bad")
    for index, expected in (
        (tars, {"lonely": "without its text pair", "textonly": "without its media pair", "broken": "cannot decode image"}),
        (llava, {"noanswer": "no assistant turn", "nomedia": "<image> placeholder without its image",
                 "gone.jpg": "cannot decode image"}),
    ):  # fmt: skip
        out = tmp_path / Path(index).name.replace("{", "")
        config = tiny_config(synthetic_dir, tmp_path, data__train_index=index, data__val_index="null", data__on_bad_sample="skip")
        manifest = prepare_set(config, out, processes=1, part=(0, 1), shard_size=2)
        assert manifest is not None and manifest["splits"]["train"]["samples"] == 2
        lines = [json.loads(line) for line in (out / BAD_SAMPLES_NAME).read_text().splitlines()]
        assert len(lines) == 3
        for culprit, reason in expected.items():
            assert any(culprit in f"{b['where']}: {b['error']}" and reason in b["error"] for b in lines), (culprit, lines)
        capped = tiny_config(synthetic_dir, tmp_path, data__train_index=index, data__val_index="null",
                             data__on_bad_sample="skip", data__max_bad_samples=2)  # fmt: skip
        with pytest.raises(PreparedSetError) as refused:
            prepare_set(capped, tmp_path / f"capped-{out.name}", processes=1, part=(0, 1), shard_size=2)
        assert "above data.max_bad_samples=2" in refused.value.lines()[-1]


def test_a_bad_index_is_one_line_naming_the_culprit_and_exit_2(synthetic_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}\n')
    for index, message in (
        (str(tmp_path / "shards/{00000..00003}.tar"), "index file does not exist (from"),
        (str(tmp_path / "a.jsonl"), "a.jsonl:1: turn 2 has role 'robot'"),
    ):
        overrides = tiny_overrides(synthetic_dir, tmp_path, data__train_index=index, data__val_index="null")
        done = subprocess.run(
            [sys.executable, str(REPO / "train_phase2.py"), "prepare", "--config", str(DEFAULT_CONFIG),
             "--out", str(tmp_path / "o"), *overrides],
            capture_output=True, text=True, env=python_env(), cwd=REPO, timeout=300,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr[-2000:]
        assert message in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_llava_and_messages_files_train_directly_from_the_raw_index(tmp_path: Path) -> None:
    """read_index (the raw path's scan) takes LLaVA and messages files: one user and one assistant turn
    as prompt and response (our JSONL's records, the placeholders kept for the text encoder to place
    the media), longer conversations kept whole as turns."""
    items = real_items(4)
    ours = read_index(write_ours(tmp_path, items))
    for path in (write_llava(tmp_path, items), write_messages(tmp_path, items)):
        records = read_index(path)
        assert [{k: r[k] for k in ("id", "prompt", "response", "image", "audio")} for r in records] == [
            {**{k: o[k] for k in ("id", "response", "image", "audio")}, "prompt": marked(item)}
            for o, item in zip(ours, items, strict=True)
        ]
    turns = [
        {"from": "human", "value": "a"},
        {"from": "gpt", "value": "b"},
        {"from": "human", "value": "c"},
        {"from": "gpt", "value": "d"},
    ]
    (tmp_path / "multi.jsonl").write_text(json.dumps({"id": "m", "conversations": turns}) + "\n")
    (record,) = read_index(tmp_path / "multi.jsonl")
    assert json.loads(record["turns"]) == [["user", "a"], ["assistant", "b"], ["user", "c"], ["assistant", "d"]]
    (tmp_path / "shard.parquet").write_bytes(b"")
    with pytest.raises(IndexFileError, match=r"train from a prepared set"):
        read_index(tmp_path / "shard.parquet")


# --------------------------------------------------------------------------- properties


@given(first=st.integers(0, 500), length=st.integers(0, 40), width=st.integers(1, 5))
def test_a_brace_range_expands_like_the_shells(first: int, length: int, width: int) -> None:
    last = first + length
    pattern = f"s/{{{str(first).zfill(width)}..{str(last).zfill(width)}}}.tar"
    padded = width if width > 1 or first == 0 else 0
    expected = [f"s/{str(n).zfill(padded if str(first).zfill(width).startswith('0') else 0)}.tar" for n in range(first, last + 1)]
    assert expand_braces(pattern) == expected


def test_a_glob_with_braces_names_the_files_in_order(tmp_path: Path) -> None:
    for n in (3, 1, 2, 10):
        (tmp_path / f"{n:05d}.tar").write_bytes(b"")
    assert [p.name for p in expand(str(tmp_path / "{00001..00003}.tar"))] == ["00001.tar", "00002.tar", "00003.tar"]
    assert [p.name for p in expand(str(tmp_path / "*.tar"))] == ["00001.tar", "00002.tar", "00003.tar", "00010.tar"]


@settings(max_examples=40, deadline=None)
@given(texts=st.lists(st.text(max_size=30), min_size=1, max_size=25), array=st.booleans(), data=st.data())
def test_json_values_resume_at_any_records_offset(
    texts: list[str], array: bool, data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = tmp_path_factory.mktemp("json") / "f.json"
    values = [{"n": n, "t": t} for n, t in enumerate(texts)]
    path.write_text(
        json.dumps(values, ensure_ascii=False, indent=1)
        if array
        else "".join(json.dumps(v, ensure_ascii=False) + "\n" for v in values)
    )
    read = list(iter_values(path))
    assert [v for _, _, v in read] == values
    k = data.draw(st.integers(0, len(values) - 1))
    number, offset, _ = read[k]
    assert [v for _, _, v in iter_values(path, offset, number - 1)] == values[k:]


def resumed_ids(index: str, shard_size: int, synthetic_dir: Path, tmp: Path) -> tuple[list[str], list[str]]:
    """(every sample's id in order, the ids read back shard by shard from the survey's resume points)."""
    config = tiny_config(synthetic_dir, tmp, data__train_index=index, data__val_index="null")
    found = survey(index, config, ReadOptions(), shard_size)
    whole = [r.id for path in expand(index) for _, r in read_records(path, found.format) if isinstance(r, Record)]
    pieces = []
    for path, offset, ordinal, count in found.chunks:
        records = itertools.islice(read_records(Path(path), found.format, offset, ordinal), count)
        pieces += [r.id for _, r in records if isinstance(r, Record)]
    assert found.records == len(whole)
    return whole, pieces


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    count=st.integers(1, 23),
    per_shard=st.integers(1, 9),
    shard_size=st.integers(1, 10),
    fmt=st.sampled_from(["webdataset", "parquet", "llava", "messages"]),
)
def test_every_sample_is_in_exactly_one_prepared_shard(
    count: int, per_shard: int, shard_size: int, fmt: str, synthetic_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Over sample counts, shards per file and prepared shard sizes that need not divide: the shards'
    resume points (byte offsets, Parquet rows) read every sample once, in order."""
    folder = tmp_path_factory.mktemp("sets")
    items = [Item(f"k{n:04d}", "p", f"r{n}", ICON if n % 3 else None, None, caption_only=n % 2 == 0) for n in range(count)]
    index = {
        "webdataset": lambda: write_tars(folder, items, per_shard),
        "parquet": lambda: write_parquet(folder, items, per_shard, row_group=max(1, per_shard // 2)),
        "llava": lambda: str(write_llava(folder, items)),
        "messages": lambda: str(write_messages(folder, items)),
    }[fmt]()
    whole, pieces = resumed_ids(index, shard_size, synthetic_dir, folder)
    assert whole == pieces == [item.id for item in items]


def test_an_empty_answer_is_a_bad_sample_in_every_format(tmp_path: Path) -> None:
    """An empty caption (or any empty assistant turn) would train an empty answer: a bad sample, named.
    (Our JSONL refuses an empty response already: "field 'response' must be a non-empty string".)"""
    import io
    import tarfile

    (tmp_path / "llava.json").write_text(
        json.dumps([{"id": "c", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]}])
    )
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "and?"}]
    (tmp_path / "messages.jsonl").write_text(
        json.dumps({"id": "d", "messages": [*messages, {"role": "assistant", "content": " "}]}) + "\n"
    )
    with tarfile.open(tmp_path / "shard.tar", "w") as tar:
        for name, data in (("k.jpg", b"not decoded here"), ("k.txt", b"  \n")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    problems = {
        record["id"]: record["problem"]
        for name in ("llava.json", "messages.jsonl")
        for record in read_index(tmp_path / name, check_media=False)
    }
    ((_, caption),) = read_records(tmp_path / "shard.tar", "webdataset", load_media=False)
    assert isinstance(caption, Record)
    assert problems["c"] == "an empty assistant turn (turn 2): it would train an empty answer (an empty caption?)"
    assert problems["d"] == "an empty assistant turn (turn 4): it would train an empty answer (an empty caption?)"
    assert caption.problem == problems["c"]


def test_an_opening_assistant_turn_is_dropped_as_llava_drops_it(tmp_path: Path) -> None:
    """A conversation that opens with the assistant ("Hello! How can I help?") trains from the first
    user turn on, as LLaVA's preprocessing does; a system turn before it stays."""
    (tmp_path / "llava.json").write_text(
        json.dumps(
            [
                {
                    "id": "l",
                    "conversations": [
                        {"from": "gpt", "value": "Hello!"},
                        {"from": "human", "value": "q"},
                        {"from": "gpt", "value": "a"},
                    ],
                }
            ]
        )
    )
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]
    (tmp_path / "messages.jsonl").write_text(json.dumps({"id": "m", "messages": messages}) + "\n")
    (llava,) = read_index(tmp_path / "llava.json", check_media=False)
    (chat,) = read_index(tmp_path / "messages.jsonl", check_media=False)
    assert llava["problem"] is None and (llava["prompt"], llava["response"]) == ("q", "a")  # one question, one answer
    assert chat["problem"] is None
    assert json.loads(chat["turns"]) == [
        ["system", "be brief"],
        ["user", "q"],
        ["assistant", "a"],
        ["user", "q2"],
        ["assistant", "a2"],
    ]


@pytest.mark.parametrize("damage", ["inside a member", "at a member's boundary", "a header's checksum"])
def test_a_cut_tar_keeps_the_samples_before_the_damage_under_skip(tmp_path: Path, synthetic_dir: Path, damage: str) -> None:
    """A shard cut short (a copy that stopped) or with a bad header: under skip the samples before the
    damage are kept and the rest is one bad sample, listed; under error the prepare is refused naming
    the file. The whole prepare stopped on a cut inside a member, and tarfile read the other two as
    the tar's end: the samples after them were lost without a word."""
    import tarfile

    folder = tmp_path / "cut"
    folder.mkdir()
    with tarfile.open(folder / "00000.tar", "w") as tar:
        for n in range(4):
            add_member(tar, f"s{n}.png", ICON.read_bytes())
            add_member(tar, f"s{n}.txt", f"a blue present {n}".encode())
    whole = bytearray((folder / "00000.tar").read_bytes())
    with tarfile.open(folder / "00000.tar") as tar:
        third, fourth = tar.getmember("s2.png"), tar.getmember("s3.png")
    kept = {"inside a member": 2, "at a member's boundary": 3, "a header's checksum": 3}[damage]
    if damage == "inside a member":
        damaged = whole[: third.offset_data + 100]  # inside the third picture
    elif damage == "at a member's boundary":
        damaged = whole[: fourth.offset]  # s0-s2 whole, then nothing: no end-of-archive blocks
    else:
        damaged = whole
        damaged[fourth.offset + 148] ^= 0xFF  # the fourth sample's header checksum
    (folder / "00000.tar").write_bytes(bytes(damaged))
    index = str(folder / "{00000..00000}.tar")
    config = tiny_config(synthetic_dir, tmp_path, data__train_index=index, data__val_index="null", data__on_bad_sample="skip")
    manifest = prepare_set(config, tmp_path / "set", processes=1, part=(0, 1), shard_size=2)
    assert manifest is not None and manifest["splits"]["train"]["samples"] == kept, manifest
    (bad,) = [json.loads(line) for line in (tmp_path / "set" / BAD_SAMPLES_NAME).read_text().splitlines()]
    assert bad["where"].endswith("00000.tar") and bad["error"].startswith(f"tar file cut or damaged after sample {kept} ("), bad
    refusing = tiny_config(synthetic_dir, tmp_path, data__train_index=index, data__val_index="null")
    with pytest.raises(PreparedSetError) as refused:
        prepare_set(refusing, tmp_path / "refused", processes=1, part=(0, 1), shard_size=2)
    named = f"00000.tar: tar file cut or damaged after sample {kept}"
    assert any(named in line for line in refused.value.lines()), refused.value.lines()


def test_tar_pairing_messages_say_why_a_pair_was_not_made(tmp_path: Path) -> None:
    """A dot in the key (WebDataset splits at the first dot) and a pair written apart (an unsorted tar)
    are said as such, not only "without its text pair"."""
    import tarfile

    with tarfile.open(tmp_path / "shard.tar", "w") as tar:
        add_member(tar, "img.001.jpg", b"x")
        add_member(tar, "img.001.txt", b"a caption")
        add_member(tar, "k.jpg", b"x")
        add_member(tar, "other.jpg", b"x")
        add_member(tar, "other.txt", b"fine")
        add_member(tar, "k.txt", b"k's caption, written apart")
    found = [
        (r.id, r.problem) for _, r in read_records(tmp_path / "shard.tar", "webdataset", load_media=False) if isinstance(r, Record)
    ]
    assert [sample for sample, _ in found] == ["img", "k", "other", "k"]
    (_, dotted), (_, first), (_, fine), (_, apart) = found
    assert "WebDataset splits a name at its first dot, so img.001.jpg is key 'img' with extension '001.jpg'" in str(dotted)
    assert fine is None and first is not None and first.startswith("k.jpg without its text pair"), first
    assert apart is not None and "key 'k' also stands elsewhere in the shard" in apart and "tar --sort=name" in apart, apart


def test_parquet_media_in_a_column_the_config_does_not_name_is_refused_and_decoded_audio_is_read(tmp_path: Path) -> None:
    """A picture column named `photo` prepared as text only, "complete, 0 left out"; so did the
    `datasets` Audio feature decoded ({array, sampling_rate}). Now the first is named in one line and
    the second read as the sound it is."""
    import io

    import numpy as np
    import pyarrow.parquet as pq
    import soundfile

    from purrsight.data.formats.records import MediaBlob, RecordError

    media = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    photo = {"bytes": ICON.read_bytes(), "path": "present.png"}
    pq.write_table(
        pa.table({"id": ["a"], "caption": ["a blue present"], "photo": pa.array([photo], media)}), tmp_path / "photo.parquet"
    )
    with pytest.raises(
        RecordError, match=r"photo.parquet: column 'photo' holds media \(\{bytes, path\} structs\) that data.fields"
    ):
        list(read_records(tmp_path / "photo.parquet", "parquet", load_media=False))
    # Named columns are read, a second picture column beside a named one is the user's to name, and a
    # binary digest is no picture: none of them refused.
    digest = pa.array([b"\x00" * 16])
    table = pa.table(
        {"id": ["a"], "caption": ["x"], "image": pa.array([photo], media), "mask": pa.array([photo], media), "md5": digest}
    )
    pq.write_table(table, tmp_path / "named.parquet")
    ((_, named),) = read_records(tmp_path / "named.parquet", "parquet", load_media=False)
    assert isinstance(named, Record) and named.problem is None

    wave = np.sin(np.linspace(0, 200, 1600)).astype(np.float32)
    decoded = pa.struct([("array", pa.list_(pa.float32())), ("sampling_rate", pa.int64()), ("path", pa.string())])
    sound = pa.array([{"array": wave.tolist(), "sampling_rate": 16000, "path": None}], decoded)
    pq.write_table(pa.table({"id": ["b"], "caption": ["a tone"], "audio": sound}), tmp_path / "sound.parquet")
    ((_, record),) = read_records(tmp_path / "sound.parquet", "parquet")
    assert isinstance(record, Record) and record.problem is None and isinstance(record.audio, MediaBlob)
    samples, rate = soundfile.read(io.BytesIO(record.audio.data), dtype="float32")
    assert rate == 16000 and np.allclose(samples, wave)
    stereo = pa.struct([("array", pa.list_(pa.list_(pa.float32()))), ("sampling_rate", pa.int64()), ("path", pa.string())])
    both = pa.array([{"array": [wave.tolist(), wave.tolist()], "sampling_rate": 16000, "path": None}], stereo)
    pq.write_table(pa.table({"id": ["c"], "caption": ["two"], "audio": both}), tmp_path / "stereo.parquet")
    ((_, two),) = read_records(tmp_path / "stereo.parquet", "parquet")  # datasets' mono=False: (channels, samples)
    assert isinstance(two, Record) and isinstance(two.audio, MediaBlob)
    assert soundfile.read(io.BytesIO(two.audio.data))[0].shape == (1600, 2)


def test_a_refusals_advice_followed_into_the_same_folder_prepares(synthetic_dir: Path, tmp_path: Path) -> None:
    """`prepare` refuses bad samples and says "set data.on_bad_sample=skip to leave them out"; run so
    into the same --out, it was refused as "other settings". The shards done under error stand."""
    tars, _ = bad_set(tmp_path / "bad")
    refusing = tiny_config(synthetic_dir, tmp_path, data__train_index=tars, data__val_index="null")
    with pytest.raises(PreparedSetError) as refused:
        prepare_set(refusing, tmp_path / "set", processes=1, part=(0, 1), shard_size=2)
    assert "set data.on_bad_sample=skip to leave them out" in refused.value.lines()[-1]
    skipping = tiny_config(synthetic_dir, tmp_path, data__train_index=tars, data__val_index="null", data__on_bad_sample="skip")
    manifest = prepare_set(skipping, tmp_path / "set", processes=1, part=(0, 1), shard_size=2)
    assert manifest is not None and manifest["splits"]["train"]["samples"] == 2
    with pytest.raises(PreparedSetError, match=r"holds a prepare of other sources or settings \(on_bad_sample"):
        prepare_set(refusing, tmp_path / "set", processes=1, part=(0, 1), shard_size=2)  # shards that left bad samples out


def test_media_root_means_the_same_for_our_jsonl_raw_and_prepared(synthetic_dir: Path, tmp_path: Path) -> None:
    """Our JSONL's media paths are relative to data.media_root when it is set, on the raw path as in
    `prepare` and as for LLaVA files (raw, they were relative to the index's folder whatever it said)."""
    (tmp_path / "elsewhere").mkdir()
    index = tmp_path / "elsewhere" / "train.jsonl"
    index.write_text("\n".join((synthetic_dir / "train.jsonl").read_text().splitlines()[:3]) + "\n")
    with pytest.raises(IndexFileError, match=r"image file .*elsewhere/images/.* does not exist"):
        read_index(index)  # no media_root: the index's folder
    records = read_index(index, options=ReadOptions(media_root=synthetic_dir))
    media = [Path(record[kind]) for record in records for kind in ("image", "audio") if record[kind]]
    assert media and all(path.is_file() and path.is_relative_to(synthetic_dir) for path in media)
    config = tiny_config(
        synthetic_dir, tmp_path, data__train_index=str(index), data__val_index="null", data__media_root=str(synthetic_dir)
    )
    manifest = prepare_set(config, tmp_path / "set", processes=1, part=(0, 1), shard_size=8)
    assert manifest is not None and manifest["splits"]["train"]["samples"] == 3
