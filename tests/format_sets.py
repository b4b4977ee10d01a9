"""One list of samples written in each input format with that format's own library (json, tarfile,
pyarrow.parquet): tests/unit/test_formats.py and tests/integration/test_format_training.py prepare
and train them, and compare each with the same samples in our JSONL."""

from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Item:
    id: str
    prompt: str
    response: str
    image: Path | None = None
    audio: Path | None = None
    caption_only: bool = False  # tar / Parquet: a caption (the response) and no prompt


def items_of(data: Path, count: int | None = None) -> list[Item]:
    """The first ``count`` samples of a generated set's train.jsonl (purrsight/data/synthetic.py) as Items."""
    items = []
    for line in (data / "train.jsonl").read_text().splitlines()[:count]:
        record = json.loads(line)
        media = {k: data / record[k] if record.get(k) else None for k in ("image", "audio")}
        items.append(Item(record["id"], record["prompt"], record["response"], media["image"], media["audio"]))
    return items


def write_ours(folder: Path, items: list[Item]) -> Path:
    path = folder / "ours.jsonl"
    lines = []
    for item in items:
        record: dict[str, object] = {"id": item.id, "prompt": item.prompt, "response": item.response}
        record.update({k: str(v) for k, v in (("image", item.image), ("audio", item.audio)) if v is not None})
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def marked(item: Item, where: str = "front") -> str:
    """The prompt with LLaVA's placeholders: in front, as llava_instruct_150k.json writes them, or
    ``where="varied"``: in front, inside or after the prompt, by the sample's number."""
    placeholders = [p for p, media in (("<image>", item.image), ("<audio>", item.audio)) if media]
    if where == "front" or not placeholders:
        return "".join(p + "\n" for p in placeholders) + item.prompt
    words = item.prompt.split(" ")
    cut = (int("".join(filter(str.isdigit, item.id)) or 0) % 3) * len(words) // 2  # 0, the middle, the end
    return " ".join([*words[:cut], *placeholders, *words[cut:]])


def write_llava(folder: Path, items: list[Item], where: str = "front") -> Path:
    """A top-level JSON array, as llava_instruct_150k.json is."""
    records = []
    for item in items:
        record: dict[str, object] = {
            "id": item.id,
            "conversations": [{"from": "human", "value": marked(item, where)}, {"from": "gpt", "value": item.response}],
        }
        record.update({k: str(v) for k, v in (("image", item.image), ("audio", item.audio)) if v is not None})
        records.append(record)
    path = folder / "llava.json"
    path.write_text(json.dumps(records, indent=1))
    return path


def write_messages(folder: Path, items: list[Item], where: str = "front") -> Path:
    path = folder / "messages.jsonl"
    with path.open("w") as handle:
        for item in items:
            messages = [{"role": "user", "content": marked(item, where)}, {"role": "assistant", "content": item.response}]
            record = {
                "id": item.id,
                "messages": messages,
                "images": [str(item.image)] if item.image else [],
                "audios": [str(item.audio)] if item.audio else [],
            }
            handle.write(json.dumps(record) + "\n")
    return path


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_tars(folder: Path, items: list[Item], per_shard: int) -> str:
    """img2dataset's layout: KEY.jpg / KEY.wav, KEY.txt (a caption) or KEY.json (prompt, response); the brace pattern."""
    shards = folder / "shards"
    shards.mkdir()
    count = 0
    for count, start in enumerate(range(0, len(items), per_shard), start=1):
        with tarfile.open(shards / f"{count - 1:05d}.tar", "w") as tar:
            for item in items[start : start + per_shard]:
                if item.image:
                    add_member(tar, f"{item.id}{item.image.suffix}", item.image.read_bytes())
                if item.audio:
                    add_member(tar, f"{item.id}{item.audio.suffix}", item.audio.read_bytes())
                if item.caption_only:
                    add_member(tar, f"{item.id}.txt", item.response.encode())
                else:
                    add_member(tar, f"{item.id}.json", json.dumps({"prompt": item.prompt, "response": item.response}).encode())
    return str(shards / f"{{00000..{count - 1:05d}}}.tar")


def write_parquet(folder: Path, items: list[Item], per_file: int, row_group: int) -> str:
    """The Hugging Face layout: image and audio as {bytes, path} structs; the glob."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    media = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("response", pa.string()), ("caption", pa.string()),
                        ("image", media), ("audio", media)])  # fmt: skip
    shards = folder / "parquet"
    shards.mkdir()
    for number, start in enumerate(range(0, len(items), per_file)):
        rows = []
        for item in items[start : start + per_file]:
            rows.append(
                {
                    "id": item.id,
                    "prompt": None if item.caption_only else item.prompt,
                    "response": None if item.caption_only else item.response,
                    "caption": item.response if item.caption_only else None,
                    "image": {"bytes": item.image.read_bytes(), "path": item.image.name} if item.image else None,
                    "audio": {"bytes": item.audio.read_bytes(), "path": item.audio.name} if item.audio else None,
                }
            )
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), shards / f"train-{number:05d}.parquet", row_group_size=row_group)
    return str(shards / "*.parquet")
