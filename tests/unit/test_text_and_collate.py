from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from purrsight.data.dataset import Collator, MultiModalDataset, Sample, check_prompt_lengths
from purrsight.data.index import RecordTable, SampleIndex, scan_index
from purrsight.data.media import AudioDecoder, ImageDecoder, SampleError
from purrsight.data.text import PromptTooLongError, TemplateRefusedError, TextEncoder
from purrsight.labels import IGNORE_INDEX
from purrsight.model.llm import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(synthetic_dir: Path):  # type: ignore[no-untyped-def]
    return load_tokenizer(synthetic_dir / "tokenizer")


def test_labels_cover_the_response_only(tokenizer) -> None:  # type: ignore[no-untyped-def]
    encoded = TextEncoder(tokenizer, 64)("What colour is the cat?", "The cat is red.")
    prompt_len = len(tokenizer("What colour is the cat?", add_special_tokens=False)["input_ids"]) + 1  # + <bos>
    assert encoded.labels[:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert encoded.labels[prompt_len:] == encoded.input_ids[prompt_len:]
    assert encoded.input_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(encoded.input_ids[prompt_len:-1]).strip() == "The cat is red."


def test_truncation_keeps_the_prompt_and_refuses_a_prompt_too_long(tokenizer) -> None:  # type: ignore[no-untyped-def]
    encoded = TextEncoder(tokenizer, 8)("What colour is the cat?", "The cat is red.")
    assert len(encoded.input_ids) == 8 and encoded.labels[-1] != IGNORE_INDEX
    with pytest.raises(PromptTooLongError, match=r"data\.max_length is 4"):
        TextEncoder(tokenizer, 4)("What colour is the cat?", "The cat is red.")


def test_chat_template_path(tokenizer) -> None:  # type: ignore[no-untyped-def]
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = (
        "{% for m in messages %}<bos> {{ m['content'] }} <eos> {% endfor %}{% if add_generation_prompt %}<bos>{% endif %}"
    )
    text = TextEncoder(tokenizer, 64)
    assert text.use_chat_template
    encoded = text("What colour is the cat?", "The cat is red.")
    n_prompt = encoded.labels.count(IGNORE_INDEX)
    assert tokenizer.decode(encoded.input_ids[:n_prompt]).startswith("<bos> What colour")
    assert "red" in tokenizer.decode([t for t in encoded.labels if t != IGNORE_INDEX])


def test_collate_pads_and_masks_missing_media() -> None:
    samples = [
        Sample("a", [5, 6, 7], [IGNORE_INDEX, 6, 7], torch.ones(3, 4, 4), None, skipped=0),
        Sample("b", [5, 6], [IGNORE_INDEX, 6], None, torch.ones(10), skipped=2),
    ]
    batch = Collator(0, torch.zeros(3, 4, 4), torch.zeros(10))(samples)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [5, 6, 0]]
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 6, 7], [IGNORE_INDEX, 6, IGNORE_INDEX]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["has_image"].tolist() == [True, False] and batch["has_audio"].tolist() == [False, True]
    assert batch["image_rows"].tolist() == [0] and batch["audio_rows"].tolist() == [1]
    assert batch["image"][1].abs().sum() == 0 and batch["num_skipped"] == 2 and batch["ids"] == ["a", "b"]
    # Counted on the CPU, carried as Python values: the training step never reads them off the GPU.
    assert (batch["num_samples"], batch["num_tokens"], batch["padded"]) == (2, 5, True)


def test_the_collators_batch_is_moved_as_lightning_would_and_any_other_shape_is_left_to_lightning() -> None:
    """``moved_batch`` (the DataModule's transfer hook) against Lightning's generic move, onto the
    meta device (one that is not the host's): every tensor moved with its dtype and shape, every
    Python value kept as the same object. A value it does not know (one with its own ``.to``, a
    list of tensors, a dict subclass) makes it answer None, for Lightning's move; and Lightning
    takes the DataModule's hook, without the warning a LightningModule's override gives."""
    import warnings

    from lightning_fabric.utilities.apply_func import move_data_to_device
    from pytorch_lightning.trainer.connectors.data_connector import _DataHookSelector

    from purrsight.data.dataset import moved_batch
    from purrsight.training.datamodule import Phase2DataModule
    from purrsight.training.module import Phase2Module

    samples = [
        Sample("a", [5, 6, 7], [IGNORE_INDEX, 6, 7], torch.ones(3, 4, 4), None, skipped=0, media_at={"image": 1}),
        Sample("b", [5, 6], [IGNORE_INDEX, 6], None, torch.ones(10), skipped=1),
    ]
    batch = Collator(0, torch.zeros(3, 4, 4), torch.zeros(10))(samples)
    assert "media_at" in batch and batch["padded"] is True
    meta = torch.device("meta")
    ours, lightnings = moved_batch(batch, meta), move_data_to_device(batch, meta)
    assert ours is not None and ours.keys() == lightnings.keys() == batch.keys()
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].device == meta and (ours[key].dtype, ours[key].shape) == (value.dtype, value.shape)
        else:
            assert ours[key] is value and lightnings[key] == value

    class Movable:
        def to(self, device: torch.device) -> Movable:
            return self

    class Batch(dict):  # type: ignore[type-arg]
        pass

    for other in ({**batch, "extra": Movable()}, {**batch, "crops": [torch.ones(2)]}, Batch(batch), [batch["labels"]]):
        assert moved_batch(other, meta) is None
    module, datamodule = Phase2Module.__new__(Phase2Module), Phase2DataModule.__new__(Phase2DataModule)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "You have overridden `transfer_batch_to_device` in `LightningModule` ..."
        chosen = _DataHookSelector(module, datamodule).get_instance("transfer_batch_to_device")
    assert chosen is datamodule


def test_collate_knows_when_nothing_is_masked() -> None:
    samples = [Sample(x, [5, 6], [IGNORE_INDEX, 6], torch.ones(3, 4, 4), torch.ones(10), skipped=0) for x in "ab"]
    batch = Collator(0, torch.zeros(3, 4, 4), torch.zeros(10))(samples)
    assert batch["padded"] is False and batch["num_tokens"] == 4
    samples[1] = Sample("b", [5, 6], [IGNORE_INDEX, 6], torch.ones(3, 4, 4), None, skipped=0)
    assert Collator(0, torch.zeros(3, 4, 4), torch.zeros(10))(samples)["padded"] is True  # an absent prefix is masked


def test_bad_sample_error_or_skip(tmp_path: Path, synthetic_dir: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    lines = (synthetic_dir / "train.jsonl").read_text().splitlines()[:4]
    for name in ("images", "audio"):
        (tmp_path / name).symlink_to(synthetic_dir / name)
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    index = scan_index(tmp_path / "train.jsonl")
    (tmp_path / "broken.png").write_bytes(b"not a png")  # sample 0 points at it; the shared media stay intact
    records = [{**r, "image": "broken.png"} if i == 0 else r for i, r in enumerate(index.records)]
    index = type(index)(index.path, RecordTable(records))
    decoders = (ImageDecoder(None, 32), AudioDecoder(None, 16000, 0.25, True))
    with pytest.raises(SampleError, match=r"train\.jsonl:1 \(id 'train-00000'\): .*broken.png: cannot decode image"):
        MultiModalDataset(index, TextEncoder(tokenizer, 64), *decoders, on_bad_sample="error")[0]
    sample = MultiModalDataset(index, TextEncoder(tokenizer, 64), *decoders, on_bad_sample="skip")[0]
    assert sample.id == "train-00001" and sample.skipped == 1


def test_skip_covers_oversized_images_and_stops_at_the_consecutive_limit(
    tmp_path: Path,
    synthetic_dir: Path,
    tokenizer,  # type: ignore[no-untyped-def]
) -> None:
    """Before, a too-large picture raised Pillow's DecompressionBombError past skip mode, and the
    run of bad neighbours allowed was a hidden 8 whatever the config said."""
    lines = (synthetic_dir / "train.jsonl").read_text().splitlines()[:6]
    for name in ("images", "audio"):
        (tmp_path / name).symlink_to(synthetic_dir / name)
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    Image.new("L", (3000, 2000)).save(tmp_path / "big.png")
    index = scan_index(tmp_path / "train.jsonl")
    records = [{**r, "image": "big.png"} if i < 3 else r for i, r in enumerate(index.records)]
    index = type(index)(index.path, RecordTable(records))
    decoders = (ImageDecoder(None, 32, max_pixels=1_000_000), AudioDecoder(None, 16000, 0.25, True))
    text = TextEncoder(tokenizer, 64)
    sample = MultiModalDataset(index, text, *decoders, on_bad_sample="skip", max_consecutive_bad=4)[0]
    assert sample.id == "train-00003" and sample.skipped == 3
    with pytest.raises(SampleError, match=r"3 consecutive bad samples from record 1 .*data\.max_consecutive_bad_samples"):
        MultiModalDataset(index, text, *decoders, on_bad_sample="skip", max_consecutive_bad=3)[0]
    with pytest.raises(SampleError, match=r"prompt is \d+ tokens, data.max_length is 3"):
        check_prompt_lengths(index.path, list(index.records), TextEncoder(tokenizer, 3).prompt_length, 3)


def test_a_chat_template_that_refuses_the_turns_makes_a_named_bad_sample(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Gemma's template raises on a system turn (Mistral's on turns that do not alternate): the sample
    is bad, named with the template's message, under data.on_bad_sample; it was a traceback."""
    import json

    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = (  # Gemma's check, as its template words it
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}<bos> {{ m['content'] }} <eos> {% endfor %}{% if add_generation_prompt %}<bos>{% endif %}"
    )
    text = TextEncoder(tokenizer, 64)
    with_system = [("system", "be brief"), ("user", "what colour?"), ("assistant", "red")]
    with pytest.raises(TemplateRefusedError, match=r"chat template refuses these turns \(system, user.*System role not supported"):
        text.encode_turns(with_system)
    records = [
        {"id": "s", "line": 1, "prompt": "what colour?", "response": "red", "turns": json.dumps(with_system)},
        {"id": "u", "line": 2, "prompt": "what colour?", "response": "red"},
    ]
    with pytest.raises(SampleError, match=r"chat\.jsonl:1 \(id 's'\): the tokenizer's chat template refuses"):
        check_prompt_lengths(tmp_path / "chat.jsonl", records, text.prompt_length, 64, text.first_prompt_length, refuse_bad=True)
    check_prompt_lengths(tmp_path / "chat.jsonl", records, text.prompt_length, 64, text.first_prompt_length)  # skip
    assert "System role not supported" in records[0]["problem"] and "problem" not in records[1]  # bad when read
    index = SampleIndex(tmp_path / "chat.jsonl", RecordTable([{**r, "image": None, "audio": None} for r in records]))
    with pytest.raises(SampleError, match=r"chat\.jsonl:1 \(id 's'\): the tokenizer's chat template refuses"):
        MultiModalDataset(index, text, None, None, on_bad_sample="error")[0]
    assert MultiModalDataset(index, text, None, None, on_bad_sample="skip")[0].id == "u"


@given(
    lengths=st.lists(st.integers(1, 100), min_size=1, max_size=6),
    multiple=st.none() | st.integers(1, 64),
    room=st.integers(0, 40),
)
def test_a_batch_is_padded_to_its_longest_or_the_next_multiple_within_max_length(
    lengths: list[int], multiple: int | None, room: int
) -> None:
    """data.pad_to_multiple_of: every length is a multiple or data.max_length itself, so a compiled
    step meets at most max_length / multiple + 1 shapes; never shorter than the batch's longest."""
    max_length = max(lengths) + room
    samples = [Sample(str(i), list(range(n)), [IGNORE_INDEX, *range(1, n)], None, None, skipped=0) for i, n in enumerate(lengths)]
    batch = Collator(0, None, None, pad_to=multiple, max_length=max_length)(samples)
    width = batch["input_ids"].shape[1]
    if multiple is None:
        assert width == max(lengths)
    else:
        assert max(lengths) <= width <= max_length and (width % multiple == 0 or width == max_length)
        assert width - max(lengths) < multiple  # the next multiple, not a later one
    for row, n in enumerate(lengths):  # the padding is masked and carries no label
        assert batch["attention_mask"][row, n:].sum() == 0 and (batch["labels"][row, n:] == IGNORE_INDEX).all()
    assert batch["num_tokens"] == sum(lengths)  # telemetry counts the real tokens, not the padding
    assert batch["padded"] == (min(lengths) < width)
