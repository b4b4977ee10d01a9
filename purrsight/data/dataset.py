"""The map-style dataset of decoded samples and the collate function that pads them."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import Dataset

from purrsight.data.index import SampleIndex
from purrsight.data.media import AudioDecoder, ImageDecoder, SampleError
from purrsight.data.text import PromptTooLongError, TemplateRefusedError, TextEncoder
from purrsight.labels import IGNORE_INDEX

log = logging.getLogger(__name__)


@dataclass
class Sample:
    id: str
    input_ids: list[int]
    labels: list[int]
    image: torch.Tensor | None  # the decoder's stored form: uint8 pixels (normalised on the device) or float32
    audio: torch.Tensor | None
    skipped: int  # bad samples replaced to produce this one
    media_at: dict[str, int] = field(default_factory=dict)  # modality -> token index its media go before (data/text.py)


class MultiModalDataset(Dataset[Sample]):
    def __init__(
        self,
        index: SampleIndex,
        text: TextEncoder,
        image: ImageDecoder | None,
        audio: AudioDecoder | None,
        on_bad_sample: Literal["error", "skip"] = "error",
        max_consecutive_bad: int = 8,
    ) -> None:
        self.index = index
        self.text = text
        self.image = image
        self.audio = audio
        self.on_bad_sample = on_bad_sample
        self.max_consecutive_bad = max_consecutive_bad

    def __len__(self) -> int:
        return len(self.index)

    def lengths(self) -> list[int]:
        """Each sample's length for data.group_by_length: the characters of its text (prompt and response,
        or a conversation's turns as stored), a proxy for its tokens that costs no tokenizer pass at start."""
        import pyarrow.compute as pc

        table = self.index.records.table
        single = pc.add(pc.fill_null(pc.utf8_length(table["prompt"]), 0), pc.fill_null(pc.utf8_length(table["response"]), 0))
        # A conversation's characters, counted when it was read (the turns column is JSON: its
        # length counted quotes, brackets and escapes, 6 characters for one accented letter).
        return pc.if_else(pc.is_null(table["turns"]), single, pc.fill_null(table["chars"], 0)).to_pylist()  # type: ignore[no-any-return]

    def _picture(self, relative: str | None) -> torch.Tensor | None:
        if self.image is None or relative is None:
            return None  # modality disabled in the config, or absent from this sample
        return self.image.stored(self.image.load(Path(self.index.root) / relative))  # uint8 where it can: the GPU normalises

    def _clip(self, relative: str | None) -> torch.Tensor | None:
        if self.audio is None or relative is None:
            return None
        return self.audio(Path(self.index.root) / relative)

    def _decode(self, i: int) -> Sample:
        record = self.index.records[i]
        try:
            if record.get("problem"):  # another format's record that cannot train (data/formats/records.py)
                raise SampleError(record["problem"])
            turns = record.get("turns")
            text = self.text.encode_turns(json.loads(turns)) if turns else self.text(record["prompt"], record["response"])
            image = self._picture(record["image"])
            audio = self._clip(record["audio"])
        except (SampleError, PromptTooLongError, TemplateRefusedError) as err:
            raise SampleError(f"{self.index.path}:{record['line']} (id {record['id']!r}): {err}") from None
        return Sample(record["id"], text.input_ids, text.labels, image, audio, skipped=0, media_at=text.media_at)

    def __getitem__(self, i: int) -> Sample:
        if self.on_bad_sample == "error":
            return self._decode(i)
        # A failed sample is replaced by the next index's sample, so every rank still yields
        # full, equally sized batches (a short batch on one DDP rank would desynchronise the
        # collectives). Many bad neighbours in a row mean a broken folder: give up.
        for attempt in range(self.max_consecutive_bad):
            try:
                sample = self._decode((i + attempt) % len(self))
            except SampleError as err:
                log.warning("skipping bad sample: %s", err)
                continue
            sample.skipped = attempt
            return sample
        raise SampleError(
            f"{self.max_consecutive_bad} consecutive bad samples from record {i + 1} of {self.index.path} "
            "(data.max_consecutive_bad_samples); the media folder is likely broken"
        )


class Collator:
    """Pads text to the longest in the batch, or up to the next multiple of ``pad_to`` (at most
    ``max_length``: a compiled step then meets a few shapes); absent media become blanks plus a mask.

    Pictures travel as the decoder stores them: uint8 ones (4x less to hand from a loader worker
    and to copy to the GPU than floats) are normalised by the model on its device
    (PurrSightModel.tower_input).
    """

    def __init__(
        self,
        pad_id: int,
        blank_image: torch.Tensor | None,
        blank_audio: torch.Tensor | None,
        pad_to: int | None = None,
        max_length: int | None = None,
    ) -> None:
        self.pad_id = pad_id
        self.pad_to = pad_to
        self.max_length = max_length
        self.blank_image = blank_image
        self.blank_audio = blank_audio

    @staticmethod
    def _stack_media(items: list[torch.Tensor | None], blank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(stacked, present mask, indices of the present rows)."""
        present = [item is not None for item in items]
        stacked = torch.stack([blank if item is None else item for item in items])
        rows = torch.tensor([row for row, has in enumerate(present) if has], dtype=torch.long)
        return stacked, torch.tensor(present), rows

    def __call__(self, samples: list[Sample]) -> dict[str, Any]:
        lengths = [len(s.input_ids) for s in samples]
        longest = max(lengths)
        if self.pad_to is not None:  # never shorter than the batch's longest; never past max_length but for it
            longest = max(longest, min(-(-longest // self.pad_to) * self.pad_to, self.max_length or longest))
        input_ids = torch.full((len(samples), longest), self.pad_id, dtype=torch.long)
        labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), longest), dtype=torch.long)
        for row, sample in enumerate(samples):
            n = lengths[row]
            input_ids[row, :n] = torch.tensor(sample.input_ids)
            labels[row, :n] = torch.tensor(sample.labels)
            attention_mask[row, :n] = 1
        # Counts and flags as Python values, worked out here on the CPU: read from the batch's
        # tensors once they are on the GPU, each would make the host wait for the device.
        batch: dict[str, Any] = {
            "input_ids": input_ids,
            "labels": labels,
            "attention_mask": attention_mask,
            "num_samples": len(samples),
            "num_tokens": sum(lengths),
            "num_labelled": int((labels != IGNORE_INDEX).sum()),  # sizes the loss's rows (model/multimodal.py)
            "num_skipped": sum(s.skipped for s in samples),
            "ids": [s.id for s in samples],
        }
        padded = min(lengths) < longest
        enabled = [(m, blank) for m, blank in (("image", self.blank_image), ("audio", self.blank_audio)) if blank is not None]
        for modality, blank in enabled:
            items = [getattr(s, modality) for s in samples]
            batch[modality], batch[f"has_{modality}"], batch[f"{modality}_rows"] = self._stack_media(items, blank)
            padded = padded or any(item is None for item in items)  # an absent modality's prefix is masked
        batch["padded"] = padded  # False: no position is masked, the LLM may attend without a mask
        # Where each enabled modality's media go in each sample's text; only when one is not in front
        # (0), so a batch of placeholder-free samples takes the model's plain concatenation.
        media_at = [[s.media_at.get(m, 0) if getattr(s, m) is not None else 0 for m, _ in enabled] for s in samples]
        if enabled and any(any(row) for row in media_at):
            batch["media_at"] = torch.tensor(media_at, dtype=torch.long)
        return batch


def moved_batch(batch: Any, device: torch.device) -> dict[str, Any] | None:
    """A batch of ``Collator``'s shape (a flat dict of tensors and plain Python values) with its
    tensors on ``device``, the rest as it is; None for any other shape, for a generic move.

    Lightning's generic move walks every value, each sample id included, with its checks at each:
    0.2% of the tiny model's step on CPU (bench/results/launch.md). ``non_blocking`` as Lightning's:
    a copy from pinned host memory to a GPU goes on while the host prepares the next step.
    """
    if type(batch) is not dict or not all(_plain(value) for value in batch.values()):
        return None
    non_blocking = device.type not in ("cpu", "mps")
    return {
        key: value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value
        for key, value in batch.items()
    }


def _plain(value: Any) -> bool:
    """A tensor, or a value no device move touches: a number, a flag, a string, None, a list of strings."""
    if isinstance(value, torch.Tensor | int | float | str) or value is None:  # bool is an int
        return True
    return type(value) is list and all(isinstance(item, str) for item in value)


def check_prompt_lengths(
    index: str | Path,
    records: list[dict[str, Any]],
    prompt_length: Callable[[str], int],
    max_length: int,
    turns_length: Callable[[list[tuple[str, str]]], int] | None = None,
    refuse_bad: bool = False,
) -> None:
    """Fail before training when a prompt (a conversation's turns before its first answer) leaves no room
    for its response; a conversation the chat template refuses is a bad sample, refused here too under
    ``refuse_bad`` (data.on_bad_sample=error: at the start, not when the run reaches it)."""
    for record in records:
        if record.get("problem"):
            continue  # a bad sample, met as one when read
        turns = record.get("turns")
        try:
            length = turns_length(json.loads(turns)) if turns and turns_length else prompt_length(record["prompt"])
        except TemplateRefusedError as err:  # a bad sample under data.on_bad_sample, met as one when read
            if refuse_bad:
                raise SampleError(f"{index}:{record['line']} (id {record['id']!r}): {err}") from None
            record["problem"] = str(err)
            continue
        if length >= max_length:
            raise SampleError(
                f"{index}:{record['line']} (id {record['id']!r}): prompt is {length} tokens, "
                f"data.max_length is {max_length}; raise data.max_length or shorten the prompt"
            )


def raw_conversations(dataset: Any, fmt: str = "auto", fields: Any = None) -> bool:
    """Whether ``dataset`` is a raw index of a conversation format (LLaVA or messages), whose samples'
    lengths changed with the grouping's version 2: a conversation's characters where its JSON's were
    counted, and turns that version 2 reads otherwise (an opening answer dropped, an empty one bad).
    From the file's format, not from its records as read now: those are version 2's."""
    from purrsight.data.formats.sources import detect

    if not isinstance(dataset, MultiModalDataset):
        return False  # a prepared set: its lengths are stored tokens
    return detect([Path(dataset.index.path)], fmt, fields) in ("llava", "messages")
