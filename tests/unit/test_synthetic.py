from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from purrsight import atomic_file
from purrsight.data.synthetic import COLOURS, PITCHES, generate
from purrsight.model.llm import load_tokenizer


def test_deterministic_from_seed(tmp_path: Path) -> None:
    a = generate(tmp_path / "a", 12, 4, seed=3)
    b = generate(tmp_path / "b", 12, 4, seed=3)
    c = generate(tmp_path / "c", 12, 4, seed=4)

    def media(folder: Path) -> dict[str, bytes]:
        return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.suffix in {".png", ".wav"}}

    assert (a / "train.jsonl").read_text() == (b / "train.jsonl").read_text()
    assert len(media(a)) >= 12 and media(a) == media(b)  # every picture and sound, byte for byte
    assert (a / "train.jsonl").read_text() != (c / "train.jsonl").read_text()
    assert media(a) != media(c)


def test_grounded_answers_and_mixed_modalities(synthetic_dir: Path) -> None:
    records = [json.loads(line) for line in (synthetic_dir / "train.jsonl").read_text().splitlines()]
    assert {("image" in r, "audio" in r) for r in records} == {(True, False), (False, True), (True, True)}
    for record in records:
        answer_words = set(record["response"].rstrip(".").split())
        assert ("image" in record) == bool(answer_words & set(COLOURS))
        assert ("audio" in record) == bool(answer_words & set(PITCHES))
        assert not answer_words & (set(COLOURS) | set(PITCHES)) & set(record["prompt"].split())  # never given away


def test_tokenizer_is_a_hugging_face_directory(synthetic_dir: Path) -> None:
    tokenizer = load_tokenizer(synthetic_dir / "tokenizer")
    ids = tokenizer("The cat is red.", add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.pad_token == "<pad>" and tokenizer.eos_token == "<eos>"


def test_existing_set_is_kept(tmp_path: Path) -> None:
    folder = generate(tmp_path / "s", 4, 2, seed=0)
    marker = folder / "train.jsonl"
    marker.write_text(marker.read_text() + "\n")
    generate(folder, 4, 2, seed=1)
    assert marker.read_text().endswith("\n\n")  # untouched: generation is skipped


def test_a_set_is_on_disk_before_it_is_renamed_into_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file and folder of the set fsynced, then the set renamed (it was renamed unsynced: a
    power cut could leave a set that looks whole, train.jsonl there, with empty pictures)."""
    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recording_replace(src: str | Path, dst: str | Path) -> None:
        replace(src, dst)
        events.append(("rename", str(dst)))

    monkeypatch.setattr(atomic_file.os, "fsync", recording_fsync)
    monkeypatch.setattr(atomic_file.os, "replace", recording_replace)
    out = generate(tmp_path / "s", 4, 2, seed=0)
    assert ("rename", str(out)) in events, events
    before_rename = events[: events.index(("rename", str(out)))]
    synced = {Path(path).name for kind, path in before_rename if kind == "fsync"}
    assert {path.name for path in out.rglob("*")} <= synced
    assert [path.name for path in tmp_path.iterdir()] == ["s"]  # no temp folder left
