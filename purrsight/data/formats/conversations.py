"""LLaVA ``conversations`` and ms-swift / LLaMA-Factory ``messages`` records, JSON or JSONL.

LLaVA::

    {"id": "000000033471", "image": "coco/train2017/000000033471.jpg",
     "conversations": [{"from": "human", "value": "<image>\\nWhat are the colors of the bus?"},
                       {"from": "gpt", "value": "The bus is white and red."}, ...]}

messages::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "<image>What is this?"},
                  {"role": "assistant", "content": "A cat."}], "images": ["cats/1.jpg"], "audios": []}

(``content`` may also be a list of parts: ``{"type": "text", "text": ...}``, ``{"type": "image"}``.)
Media paths are relative to ``data.media_root``, else to the file's folder. A record of the
wrong shape (no turns, an unknown role) is an error in the file, named by line; what makes a
sample unusable but the file sound (no assistant turn, a placeholder without its media, two
pictures) is a bad sample (records.Record.problem).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from purrsight.data.formats.records import (
    PLACEHOLDERS,
    ROLES,
    FieldNames,
    Record,
    RecordError,
    Turn,
    conversation_record,
)


def turns_key(value: Any, fields: FieldNames) -> str | None:
    """The key of ``value``'s list of turns (the first of data.fields.conversations it has)."""
    if not isinstance(value, dict):
        return None
    return next((key for key in fields.conversations if isinstance(value.get(key), list)), None)


def turn_style(value: Any, fields: FieldNames) -> str | None:
    """ "llava" (turns with from/value), "messages" (role/content) or None: what a record looks like."""
    key = turns_key(value, fields)
    if key is None or not value[key] or not isinstance(value[key][0], dict):
        return None
    return "llava" if "from" in value[key][0] else "messages" if "role" in value[key][0] else None


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # parts: text and media markers, in order
        pieces = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            elif kind in PLACEHOLDERS:
                pieces.append(PLACEHOLDERS[kind])
            else:
                raise RecordError(f"{where}: a content part must be {{type: text|image|audio}}, got {part!r:.80}")
        return "\n".join(pieces)
    raise RecordError(f"{where}: a turn's text must be a string or a list of parts, got {type(content).__name__}")


def _turns(raw: list[Any], where: str) -> list[Turn]:
    turns = []
    for number, turn in enumerate(raw, start=1):
        if not isinstance(turn, dict):
            raise RecordError(f"{where}: turn {number} must be an object, got {type(turn).__name__}")
        role = turn.get("from", turn.get("role"))
        if role not in ROLES:
            raise RecordError(f"{where}: turn {number} has role {role!r} (expected one of {', '.join(sorted(ROLES))})")
        turns.append((ROLES[role], _content(turn.get("value", turn.get("content")), f"{where}: turn {number}")))
    return turns


def _paths(value: dict[str, Any], keys: tuple[str, ...], where: str) -> list[str]:
    found: list[str] = []
    for key in keys:
        entry = value.get(key)
        entries = entry if isinstance(entry, list) else [] if entry is None else [entry]
        for item in entries:
            if not isinstance(item, str) or not item:
                raise RecordError(f"{where}: {key!r} must hold path strings, got {item!r:.80}")
            found.append(item)
    return found


def conversation_from(value: Any, path: Path, number: int, fields: FieldNames, media_root: Path) -> Record:
    """The Record of one LLaVA or messages object (line or array element ``number`` of ``path``)."""
    sample_id = value.get(fields.id) if isinstance(value, dict) else None
    where = f"{path}:{number}" + (f" (id {sample_id!r})" if sample_id is not None else "")
    key = turns_key(value, fields)
    if key is None:
        names = " or ".join(repr(k) for k in fields.conversations)
        raise RecordError(f"{where}: expected an object with a list of turns under {names} (data.fields.conversations)")
    turns = _turns(value[key], where)
    images = _paths(value, ("image", "images"), where)
    audios = _paths(value, ("audio", "audios"), where)
    image = media_root / images[0] if images else None
    audio = media_root / audios[0] if audios else None
    sample_id = str(sample_id) if sample_id is not None else f"{path.name}:{number}"
    return conversation_record(sample_id, number, where, turns, image, audio, {"image": len(images), "audio": len(audios)})
