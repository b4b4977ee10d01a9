"""Media go where the sample's placeholder stood (data/text.py, model/multimodal.py): the text
encoder's positions, the collator's ``media_at``, and the model's placement against a plain oracle."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from purrsight.data.dataset import Collator, Sample
from purrsight.data.index import read_index
from purrsight.data.text import TextEncoder, drop_breaks, split_at_placeholders
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
        return "".join(piece for modality, piece in split_at_placeholders(drop_breaks(s)) if modality is None)

    assert text("<image>\nwho is it") == text("who is it\n<image>") == "who is it"
    assert text("a\n<image>\nb") == "a\nb" and text("look <audio> here") == "look  here"
    assert text("<image>who") == "who" and text("a\n\n<image>") == "a\n"  # one break, not every
    assert [m for m, _ in split_at_placeholders(drop_breaks("<image>\n<audio>\nq")) if m] == ["image", "audio"]


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
    # Without its line break, or alone in the turn (a messages image-only turn): the template's own
    # line break after the role stays (it ate it once), and the media still go right after it.
    for content in ("<image>what colour is the cat", "<image>"):
        alone = text.encode_turns([("user", content), ("assistant", "red")])
        stripped = text.encode_turns([("user", content.removeprefix("<image>")), ("assistant", "red")])
        assert alone.input_ids == stripped.input_ids and alone.media_at == {"image": len(head)}, content


def test_ours_joins_a_turn_after_its_leading_placeholders(synthetic_dir: Path) -> None:
    """A space joins turns in ours; a turn that starts with a placeholder gets it after the
    placeholder, so the word after it is the same token as without one."""
    text = TextEncoder(load_tokenizer(synthetic_dir / "tokenizer"), 200)
    without = text.encode_turns([("system", "be brief"), ("user", "what colour"), ("assistant", "red")])
    for user, answer in (("<image>\nwhat colour", "<audio>red"), ("<image> <audio> what colour", "red")):
        with_media = text.encode_turns([("system", "be brief"), ("user", user), ("assistant", answer)])
        assert with_media.input_ids == without.input_ids and with_media.labels == without.labels, user
        assert set(with_media.media_at) == {"image", "audio"}


def test_placeholders_are_checked_in_every_format(tmp_path: Path) -> None:
    """Our JSONL's text means what LLaVA's does: a placeholder without its media, two of one kind, or
    one in an answer make a bad sample (named), never a silently dropped word."""
    from purrsight.data.formats.records import ReadOptions
    from purrsight.data.formats.streams import read_records

    (tmp_path / "a.png").write_bytes(b"")
    lines = [
        {"id": "fine", "prompt": "look <image> here", "response": "a cat", "image": "a.png"},
        {"id": "nomedia", "prompt": "what does <image> show", "response": "x"},
        {"id": "two", "prompt": "<image> and <image>", "response": "x", "image": "a.png"},
        {"id": "answer", "prompt": "q", "response": "see <image>", "image": "a.png"},
    ]
    index = tmp_path / "ours.jsonl"
    index.write_text("".join(json.dumps(line) + "\n" for line in lines))
    problems = {r.id: r.problem for _, r in read_records(index, "purrsight", options=ReadOptions()) if not isinstance(r, Exception)}
    assert {r["id"]: r["problem"] for r in read_index(index)} == problems  # the raw path's scan: the same
    assert problems["fine"] is None
    assert problems["nomedia"] == "<image> placeholder without its image"
    assert problems["two"] == "2 <image> placeholders; a sample holds one image"
    assert problems["answer"] == "<image> placeholder in an assistant turn (turn 2): media are read, never written"


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


def test_a_set_prepared_before_placement_has_its_media_in_front(synthetic_dir: Path, tmp_path: Path) -> None:
    """Shards written before image_at/audio_at existed (the columns dropped here, as that version
    wrote them) are read with the media in front; the set's other shards keep their positions."""
    import pyarrow as pa

    from purrsight.datasets.builder import build_datasets
    from purrsight.datasets.prepare_job import prepare_set
    from tests.format_sets import items_of, write_llava

    index = write_llava(tmp_path, items_of(synthetic_dir, 6))
    config = tiny_config(synthetic_dir, tmp_path, data__train_index=str(index), data__val_index="null")
    assert prepare_set(config, tmp_path / "set", processes=1, part=(0, 1), shard_size=3) is not None
    old = tmp_path / "set" / "train" / "shard-00000.arrow"
    table = pa.ipc.open_stream(pa.BufferReader(old.read_bytes())).read_all().drop_columns(["image_at", "audio_at"])
    with pa.OSFile(str(old), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    train = build_datasets(tiny_config(synthetic_dir, tmp_path, data__prepared=str(tmp_path / "set"), data__batch_size=2,
                                       data__train_index=str(index), data__val_index="null"), 1).train  # fmt: skip
    placed = [train[i].media_at for i in range(6)]  # type: ignore[index]
    assert placed[:3] == [{}, {}, {}] and all(at and set(at.values()) == {1} for at in placed[3:]), placed
