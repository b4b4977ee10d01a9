"""Media go where the sample's placeholder stood (data/text.py, model/multimodal.py): the text
encoder's positions, the collator's ``media_at``, and the model's placement against a plain oracle."""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from purrsight.data.dataset import Collator, Sample
from purrsight.data.text import TextEncoder, split_at_placeholders
from purrsight.labels import IGNORE_INDEX
from purrsight.model.llm import load_tokenizer
from purrsight.model.multimodal import media_destinations, place_media
from tests.helpers import tiny_config
from tests.unit.test_model import build_model, first_batch

TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_placeholders_leave_the_text_with_their_line_break() -> None:
    def text(s: str) -> str:
        return "".join(piece for modality, piece in split_at_placeholders(s) if modality is None)

    assert text("<image>\nwho is it") == text("who is it\n<image>") == "who is it"
    assert text("a\n<image>\nb") == "a\nb" and text("look <audio> here") == "look  here"
    assert [m for m, _ in split_at_placeholders("<image>\n<audio>\nq") if m] == ["image", "audio"]


def test_the_media_go_before_the_token_the_placeholder_stood_before(synthetic_dir: Path) -> None:
    tokenizer = load_tokenizer(synthetic_dir / "tokenizer")
    text = TextEncoder(tokenizer, 200)

    def ids(s: str) -> list[int]:
        return list(tokenizer(s, add_special_tokens=False)["input_ids"])

    # Ours (no template): <bos> prompt response <eos>; a placeholder splits the prompt's tokens there.
    middle = text("what is <image>\nin the picture", "a cat")
    assert middle.media_at == {"image": 1 + len(ids("what is "))}
    assert middle.input_ids[: middle.media_at["image"]] == [tokenizer.bos_token_id, *ids("what is ")]
    assert middle.input_ids[middle.media_at["image"] :][: len(ids("in the picture"))] == ids("in the picture")
    # At the start (LLaVA's habit): after <bos>, and the same tokens as the text without it.
    front = text("<image>\n<audio>\nwhat is it", "a cat")
    assert front.media_at == {"image": 1, "audio": 1} and front.input_ids == text("what is it", "a cat").input_ids
    assert text("what is it", "a cat").media_at == {}  # no placeholder: in front, as before
    # In a later turn: after the first answer's <eos>.
    turns = [("user", "what colour"), ("assistant", "red"), ("user", "<audio>\nand this"), ("assistant", "a hum")]
    later = text.encode_turns(turns)
    first_eos = later.input_ids.index(tokenizer.eos_token_id)
    assert later.media_at == {"audio": first_eos + 1}
    # Cut off by data.max_length: after the last token kept.
    cut = TextEncoder(tokenizer, first_eos + 1).encode_turns(turns)
    assert cut.media_at == {"audio": len(cut.input_ids)} and len(cut.input_ids) == first_eos + 1
    assert [label != IGNORE_INDEX for label in cut.labels] == [label != IGNORE_INDEX for label in later.labels[: first_eos + 1]]


def test_through_a_chat_template_the_media_go_inside_the_users_turn(synthetic_dir: Path) -> None:
    tokenizer = load_tokenizer(synthetic_dir / "tokenizer")
    tokenizer.chat_template = TEMPLATE
    text = TextEncoder(tokenizer, 400)
    turns = [("user", "<image>\nwhat colour is the cat"), ("assistant", "red"), ("user", "and the tone"), ("assistant", "low")]
    encoded = text.encode_turns(turns)
    plain = [("user", "what colour is the cat"), *turns[1:]]
    assert encoded.input_ids == text.encode_turns(plain).input_ids and encoded.labels == text.encode_turns(plain).labels
    head = tokenizer("<|im_start|>user\n", add_special_tokens=False)["input_ids"]
    assert encoded.media_at == {"image": len(head)} and encoded.input_ids[: len(head)] == head
    single = text("<image>\nwhat colour is the cat", "red")
    assert single.media_at == {"image": len(head)}


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[int], int, list[list[int]]]:
    prefix_lengths = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
    text_length = draw(st.integers(1, 9))
    rows = draw(st.integers(1, 4))
    at = [[draw(st.integers(0, text_length)) for _ in prefix_lengths] for _ in range(rows)]
    return prefix_lengths, text_length, at


def oracle(prefix_lengths: list[int], text_length: int, at: list[int]) -> list[int]:
    """The destinations of [prefix 0][prefix 1]...[text], built by walking the text and inserting."""
    starts = [sum(prefix_lengths[:m]) for m in range(len(prefix_lengths))]
    text_start = sum(prefix_lengths)
    sequence: list[int] = []
    for k in range(text_length + 1):
        for m, length in enumerate(prefix_lengths):
            if at[m] == k:
                sequence += range(starts[m], starts[m] + length)
        if k < text_length:
            sequence.append(text_start + k)
    destination = [0] * len(sequence)
    for position, source in enumerate(sequence):
        destination[source] = position
    return destination


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_media_destinations_are_the_walk_that_inserts_each_prefix_at_its_token(
    layout: tuple[list[int], int, list[list[int]]],
) -> None:
    prefix_lengths, text_length, at = layout
    got = media_destinations(prefix_lengths, text_length, torch.tensor(at, dtype=torch.long))
    assert got.tolist() == [oracle(prefix_lengths, text_length, row) for row in at]
    values = torch.arange(got.shape[1]).expand(got.shape[0], -1)
    assert (place_media(values, got).gather(1, got) == values).all()  # each position lands where it was sent


def test_the_model_places_each_part_and_keeps_prefix_in_front_without_media_at(synthetic_dir: Path, tmp_path: Path) -> None:
    config = tiny_config(synthetic_dir, tmp_path)
    model = build_model(config).model.eval()
    batch = first_batch(config)
    assert "media_at" not in batch  # the generated set has no placeholders: the plain concatenation
    rows, text_length = batch["input_ids"].shape
    at = torch.tensor([[min(2 + row, text_length), min(1 + row, text_length)] for row in range(rows)])
    with torch.no_grad():
        front = model.build_inputs(batch)
        placed = model.build_inputs({**batch, "media_at": at})
        prefix_lengths = [front["inputs_embeds"].shape[1] - text_length - model.projectors["audio"].reduced_tokens]
        prefix_lengths.append(model.projectors["audio"].reduced_tokens)
        to = media_destinations(prefix_lengths, text_length, at)
        for key in ("inputs_embeds", "labels"):
            moved = placed[key].gather(1, to.view(*to.shape, *([1] * (placed[key].dim() - 2))).expand_as(placed[key]))
            assert torch.equal(moved, front[key]), key
        image_start = int(to[0, 0])
        assert image_start == 2 + prefix_lengths[1]  # after two text tokens and the audio placed before them
        assert torch.isfinite(model.llm(**placed).loss)


def test_the_collator_sends_media_at_only_when_a_sample_places_media() -> None:
    def sample(name: str, image: bool, media_at: dict[str, int]) -> Sample:
        return Sample(name, [5, 6, 7], [IGNORE_INDEX, 6, 7], torch.ones(3, 4, 4) if image else None, None, 0, media_at)

    collate = Collator(0, torch.zeros(3, 4, 4), torch.zeros(10))
    assert "media_at" not in collate([sample("a", True, {}), sample("b", False, {})])
    # Placed media, and a placeholder whose media the sample lacks (masked anyway: in front).
    batch = collate([sample("a", True, {"image": 2}), sample("b", False, {"image": 1, "audio": 3})])
    assert batch["media_at"].tolist() == [[2, 0], [0, 0]]
    assert "media_at" not in Collator(0, None, None)([sample("a", False, {"image": 2})])
