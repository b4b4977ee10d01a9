"""One sample as every format reader yields it: turns of text, media by path or by bytes.

A reader flags what it can tell from the record alone (no assistant turn, a placeholder without
its media, a tar member without its pair) in ``Record.problem``: a bad sample, left to
``data.on_bad_sample`` and ``data.max_bad_samples`` like an undecodable picture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from purrsight.config import DataConfig

USER, ASSISTANT, SYSTEM = "user", "assistant", "system"
ROLES = {"human": USER, "user": USER, "gpt": ASSISTANT, "assistant": ASSISTANT, "system": SYSTEM}
PLACEHOLDERS = {"image": "<image>", "audio": "<audio>"}

Turn = tuple[str, str]  # (role, text): user, assistant or system


class RecordError(ValueError):
    """A record that cannot be read at all (malformed JSON, a shard with no text column): fatal, named."""


class DamagedFileError(RecordError):
    """The rest of a file that cannot be read (a cut or damaged tar): one bad sample, not a fatal
    error, so that under data.on_bad_sample=skip the samples before the damage are kept.

    ``ordinal``: the samples of the file before it (a shard of the prepare that starts here reads on
    from there, as from a record's ``line - 1``).
    """

    def __init__(self, where: str, reason: str, ordinal: int) -> None:
        super().__init__(f"{where}: {reason}")
        self.where, self.reason, self.ordinal = where, reason, ordinal


@dataclass(frozen=True)
class MediaBlob:
    """A media file's bytes from inside a shard (a tar member, a Parquet cell): decoded without unpacking.

    ``name`` says where it came from (``shard-00003.tar:KEY.jpg``) in every message about it.
    """

    data: bytes
    name: str

    @property
    def suffix(self) -> str:
        return Path(self.name).suffix

    def __str__(self) -> str:
        return self.name


Media = Path | MediaBlob


@dataclass(frozen=True)
class FieldNames:
    """Where each part of a sample is, by tar extension, JSON key or Parquet column (the first found wins)."""

    image: tuple[str, ...] = ("jpg", "jpeg", "png", "webp", "image")
    audio: tuple[str, ...] = ("flac", "wav", "mp3", "ogg", "audio")
    caption: tuple[str, ...] = ("txt", "caption", "text")
    conversations: tuple[str, ...] = ("conversations", "messages")
    prompt: str = "prompt"
    response: str = "response"
    id: str = "id"


@dataclass(frozen=True)
class ReadOptions:
    fields: FieldNames = FieldNames()
    caption_prompt: str = "Describe this."  # data.caption_prompt
    media_root: Path | None = None  # None: each file's folder

    def root_of(self, path: Path) -> Path:
        return self.media_root if self.media_root is not None else path.parent


def read_options(data: DataConfig) -> ReadOptions:
    """How the readers find a sample's parts, from ``data.fields``, ``data.caption_prompt`` and ``data.media_root``:
    every reader of an index (the trainer, prepare, the launcher's health check, the Ray driver) passes these."""
    names = data.fields
    fields = FieldNames(
        image=tuple(names.image),
        audio=tuple(names.audio),
        caption=tuple(names.caption),
        conversations=tuple(names.conversations),
        prompt=names.prompt,
        response=names.response,
        id=names.id,
    )
    return ReadOptions(fields, data.caption_prompt, Path(data.media_root) if data.media_root else None)


@dataclass
class Record:
    id: str
    line: int  # the line, record or row number (1-based) in its file: bad-sample lines name it
    where: str  # "FILE:LINE (id 'x')", "SHARD.tar: sample KEY", ...
    turns: list[Turn]
    image: Media | None = None
    audio: Media | None = None
    problem: str | None = None  # set: a bad sample, for the reason given
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def single_turn(self) -> tuple[str, str] | None:
        """(prompt, response) when the sample is one user turn and one assistant turn: our JSONL's shape."""
        if len(self.turns) == 2 and self.turns[0][0] == USER and self.turns[1][0] == ASSISTANT:
            return self.turns[0][1], self.turns[1][1]
        return None


def conversation_problem(turns: list[Turn], media: dict[str, bool]) -> str | None:
    """Why ``turns`` cannot train (None when they can); ``media``: modality -> the sample has it."""
    if not any(role == ASSISTANT for role, _ in turns):
        return "no assistant turn: nothing to train on"
    for number, (role, text) in enumerate(turns, 1):
        found = [p for p in PLACEHOLDERS.values() if p in text]
        if role == ASSISTANT and found:
            return f"{found[0]} placeholder in an assistant turn (turn {number}): media are read, never written"
        if role == ASSISTANT and not text.strip():
            return f"an empty assistant turn (turn {number}): it would train an empty answer (an empty caption?)"
    for modality, present in media.items():
        count = sum(text.count(PLACEHOLDERS[modality]) for _, text in turns)
        if count and not present:
            return f"{PLACEHOLDERS[modality]} placeholder without its {modality}"
        if count > 1:
            return f"{count} {PLACEHOLDERS[modality]} placeholders; a sample holds one {modality}"
    return None


def prompt_problem(prompt: str, response: str, has_image: bool, has_audio: bool) -> str | None:
    """conversation_problem of our JSONL's one prompt and one response: placeholders checked alike."""
    return conversation_problem([(USER, prompt), (ASSISTANT, response)], {"image": has_image, "audio": has_audio})


def opening_answers_dropped(turns: list[Turn]) -> list[Turn]:
    """Assistant turns before the first user turn dropped, as LLaVA's preprocessing drops a first turn
    not from the human: an answer to no question would train the chat template's default system
    prompt and a greeting (a system turn stays)."""
    first_user = next((i for i, (role, _) in enumerate(turns) if role == USER), len(turns))
    return [turn for i, turn in enumerate(turns) if i >= first_user or turn[0] != ASSISTANT]


def finish_turns(turns: list[Turn]) -> list[Turn]:
    """Turns after the last assistant dropped (nothing there to train). Placeholders stay: the text
    encoder takes them out and puts the media where they stood (data/text.py)."""
    last = max((i for i, (role, _) in enumerate(turns) if role == ASSISTANT), default=-1)
    return turns[: last + 1]


def conversation_record(
    sample_id: str, line: int, where: str, turns: list[Turn], image: Media | None, audio: Media | None, media_count: dict[str, int]
) -> Record:
    """A Record from raw turns: opening answers dropped, checked (conversation_problem), then finished (finish_turns)."""
    turns = opening_answers_dropped(turns)
    problem = conversation_problem(turns, {"image": image is not None, "audio": audio is not None})
    for modality, count in media_count.items():
        if count > 1 and problem is None:
            problem = f"{count} {modality} files; a sample holds one {modality}"
    return Record(sample_id, line, where, finish_turns(turns) if problem is None else turns, image, audio, problem)
