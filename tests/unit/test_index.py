from __future__ import annotations

import json
from pathlib import Path

import pytest

from purrsight.data.index import IndexFileError, scan_index


def write_index(tmp_path: Path, lines: list[str]) -> Path:
    (tmp_path / "img.png").write_bytes(b"png")
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"id": "a", "prompt": "p", "response": "r", "image": "img.png"})


def test_good_index_loads_into_datasets(tmp_path: Path) -> None:
    index = scan_index(write_index(tmp_path, [GOOD, "", json.dumps({"id": "b", "prompt": "p", "response": "r"})]))
    assert len(index) == 2
    assert index.records[0]["image"] == "img.png"
    assert index.records[1]["audio"] is None
    assert index.root == tmp_path


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"id": "b", "prompt": "p",', r"train.jsonl:2: malformed JSON"),
        (json.dumps({"id": "b", "prompt": "p"}), r"train.jsonl:2 \(id 'b'\): missing field 'response'"),
        (json.dumps({"id": "b", "prompt": "", "response": "r"}), r"train.jsonl:2 \(id 'b'\): field 'prompt' must be a non-empty"),
        (
            json.dumps({"id": "b", "prompt": "p", "response": "r", "audio": "gone.wav"}),
            r"train.jsonl:2 \(id 'b'\): audio file .*gone.wav does not exist",
        ),
        (json.dumps({"id": "a", "prompt": "p", "response": "r"}), r"train.jsonl:2: duplicate id 'a' \(first on line 1\)"),
        (json.dumps({"id": "b", "prompt": "p", "response": "r", "imagee": "x"}), r"unknown field\(s\) imagee"),
        ("[1, 2]", r"train.jsonl:2: expected a JSON object"),
    ],
)
def test_bad_line_is_named(tmp_path: Path, bad_line: str, message: str) -> None:
    with pytest.raises(IndexFileError, match=message):
        scan_index(write_index(tmp_path, [GOOD, bad_line]))


def test_empty_and_missing_index(tmp_path: Path) -> None:
    with pytest.raises(IndexFileError, match="holds no samples"):
        scan_index(write_index(tmp_path, [""]))
    with pytest.raises(IndexFileError, match="index file does not exist"):
        scan_index(tmp_path / "absent.jsonl")
