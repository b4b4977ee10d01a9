"""The chunked head and cross-entropy (model/linear_cross_entropy.py) against what it replaces:
transformers' causal-LM loss over the whole logits, at every length, mask and chunk size."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812 (torch's own spelling)
from hypothesis import given, settings
from hypothesis import strategies as st

from purrsight.labels import IGNORE_INDEX
from purrsight.model.linear_cross_entropy import chunk_rows, compiled_scorer, linear_cross_entropy, score_chunk
from purrsight.model.multimodal import labelled_rows
from purrsight.training.model_builder import build_model
from tests.helpers import tiny_config
from tests.unit.test_model import first_batch

COMPILED = compiled_scorer()  # one compiled function for every example: its recompilations are what is tested


@st.composite
def rows_and_targets(draw: st.DrawFn) -> tuple[int, int, int, list[int], int]:
    count = draw(st.integers(1, 40))
    vocab = draw(st.integers(2, 50))
    width = draw(st.integers(1, 12))
    targets = draw(st.lists(st.one_of(st.just(IGNORE_INDEX), st.integers(0, vocab - 1)), min_size=count, max_size=count))
    rows = draw(st.integers(1, count + 3))  # a chunk may hold one row, all of them, or more
    return count, vocab, width, targets, rows


@settings(max_examples=60, deadline=None)
@given(rows_and_targets(), st.booleans())
def test_loss_gradients_and_predictions_equal_the_whole_logits_cross_entropy(
    case: tuple[int, int, int, list[int], int], head_trains: bool
) -> None:
    count, vocab, width, target_list, rows = case
    generator = torch.Generator().manual_seed(count * 1000 + vocab)
    hidden = torch.randn(count, width, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, width, generator=generator, dtype=torch.float64, requires_grad=head_trains)
    targets = torch.tensor(target_list)

    logits = hidden @ weight.T
    expected = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    expected.backward()
    assert hidden.grad is not None
    expected_hidden = hidden.grad.clone()
    expected_weight = weight.grad.clone() if weight.grad is not None else None
    hidden.grad, weight.grad = None, None

    total, predicted = linear_cross_entropy(hidden, weight, targets, rows, predict=True)
    (total * 0.5).backward()  # the loss's own gradient is applied to what forward kept
    assert torch.allclose(total, expected.float(), rtol=1e-5, atol=1e-5)
    assert hidden.grad is not None and torch.allclose(hidden.grad * 2, expected_hidden, atol=1e-6)
    if head_trains:
        assert weight.grad is not None and expected_weight is not None
        assert torch.allclose(weight.grad * 2, expected_weight, atol=1e-6)
    else:
        assert weight.grad is None
    assert torch.equal(predicted, logits.argmax(dim=-1))


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 40), st.integers(1, 16), st.sampled_from(["training", "training its head", "validation"]), st.data())
def test_the_compiled_scorer_gives_the_eager_loss_gradients_and_predictions_whatever_the_last_chunk(
    count: int, rows: int, use: str, data: st.DataObject
) -> None:
    """trainer.compile's scorer (inductor on CPU) against the eager one, as training calls it (the
    hidden states' gradient, the head's too where it trains) and as validation does (predictions,
    no gradient, under inference mode), with a batch's last chunk shorter than the others or not.
    A recompilation past the scorer's limit fails the test instead of falling back to eager."""
    label = st.one_of(st.just(IGNORE_INDEX), st.integers(0, 30))
    targets = torch.tensor(data.draw(st.lists(label, min_size=count, max_size=count)))
    validation, head_trains = use == "validation", use == "training its head"
    results = []
    for score in (score_chunk, COMPILED):
        hidden = torch.randn(count, 8, generator=torch.Generator().manual_seed(count), requires_grad=not validation)
        weight = torch.randn(31, 8, generator=torch.Generator().manual_seed(rows), requires_grad=head_trains)
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), torch.inference_mode(validation):
            total, predicted = linear_cross_entropy(hidden, weight, targets, rows, validation, score)
        if not validation:
            total.backward()
        results.append((total, predicted, hidden.grad, weight.grad))
    (eager_total, eager_predicted, eager_hidden, eager_weight), (total, predicted, grad_hidden, grad_weight) = results
    assert torch.allclose(total, eager_total, rtol=1e-5, atol=1e-5)
    assert torch.equal(predicted, eager_predicted) and predicted.numel() == (count if validation else 0)
    assert (grad_hidden is None) == validation and (grad_weight is None) == (not head_trains)
    # A row's gradient sums 31 terms of magnitude ~2 in another order than eager's: fp32 rounding
    # of about 1e-6 where the sum cancels to near 0 (count=21, rows=1 and one label gave 1.3e-6
    # against an element of -0.025), so the tolerance is absolute at 1e-5, as for the head's.
    if grad_hidden is not None:
        assert eager_hidden is not None and torch.allclose(grad_hidden, eager_hidden, atol=1e-5)
    if grad_weight is not None:
        assert eager_weight is not None and torch.allclose(grad_weight, eager_weight, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 9), st.data())
def test_labelled_rows_are_the_positions_whose_next_token_is_labelled(batch: int, length: int, data: st.DataObject) -> None:
    """Exactly the pairs transformers' shift scores (position p against token p + 1), sized by the
    collator's count without reading the device: padding rows carry no label."""
    flags = data.draw(st.lists(st.booleans(), min_size=batch * length, max_size=batch * length))
    labels = torch.tensor([7 + i if flag else IGNORE_INDEX for i, flag in enumerate(flags)]).view(batch, length)
    counted = int((labels != IGNORE_INDEX).sum())
    rows, targets = labelled_rows(labels, counted)
    expected = [
        (b * length + p, int(labels[b, p + 1])) for b in range(batch) for p in range(length - 1) if labels[b, p + 1] != IGNORE_INDEX
    ]
    got = [(int(r), int(t)) for r, t in zip(rows, targets, strict=True) if t != IGNORE_INDEX]
    assert got == expected
    assert rows.shape[0] == counted  # the host's count, not the device's
    every_row, every_target = labelled_rows(labels, None)
    assert [(int(r), int(t)) for r, t in zip(every_row, every_target, strict=True) if t != IGNORE_INDEX] == expected


def test_a_chunk_holds_about_256_mib_of_fp32_logits() -> None:
    assert chunk_rows(152064) == 441
    assert chunk_rows(10) > 10**6
    assert chunk_rows(10**12) == 1


def test_the_model_loss_gradients_and_accuracy_equal_the_causal_lm_over_whole_logits(synthetic_dir: Path, tmp_path: Path) -> None:
    """PurrSightModel.forward (decoder, then the chunked head at labelled rows) against the
    LLM's own forward with labels (every position's logits, transformers' loss): the loss, every
    trainable gradient, and the per-sample accuracy read off the whole logits' argmax. Chunks of
    3 rows, media placed mid-text in one sample, one sample's labels made the model's own
    predictions (so that one sample is right and the others are not)."""
    config = tiny_config(synthetic_dir, tmp_path)
    model = build_model(config).model
    batch = first_batch(config)
    batch["media_at"] = torch.zeros(batch["input_ids"].shape[0], 2, dtype=torch.long)
    batch["media_at"][0, 0] = 3  # sample 0's image before its fourth text token
    model.train()
    with torch.no_grad():  # labels do not change the logits (teacher forcing reads input_ids)
        logits = model.llm(**model.build_inputs(batch)).logits
    prefix = logits.shape[1] - batch["labels"].shape[1]  # sample 1's media are in front
    answer = batch["labels"][1] != IGNORE_INDEX
    positions = torch.arange(batch["labels"].shape[1]) + prefix - 1
    batch["labels"][1, answer] = logits[1, positions[answer]].argmax(dim=-1)

    inputs = model.build_inputs(batch)
    reference = model.llm(**inputs)
    reference.loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    shifted_labels, predicted = inputs["labels"][:, 1:], reference.logits[:, :-1].argmax(dim=-1)  # type: ignore[index]
    expected_right = ((predicted == shifted_labels) | (shifted_labels == IGNORE_INDEX)).all(dim=1)
    model.zero_grad(set_to_none=True)

    from purrsight.model.linear_cross_entropy import attach_loss

    attach_loss(model.head, rows=3)
    scored = model(batch, accuracy=True)
    scored.loss.backward()
    assert torch.allclose(scored.loss, reference.loss, rtol=1e-5)
    got = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys() and expected
    for name, grad in got.items():
        assert torch.allclose(grad, expected[name], rtol=1e-4, atol=1e-7), name
    assert scored.correct is not None and torch.equal(scored.correct, expected_right)
    assert bool(expected_right[1]) and not expected_right.all()


def test_under_bf16_autocast_the_loss_and_gradients_are_the_causal_lms_within_bf16(synthetic_dir: Path, tmp_path: Path) -> None:
    """As training computes under bf16-mixed on a CPU: the head's matmul in bf16, the log-softmax in fp32."""
    config = tiny_config(synthetic_dir, tmp_path)
    model = build_model(config).model
    batch = first_batch(config)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = model.llm(**model.build_inputs(batch))
    reference.loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scored = model(batch)
    scored.loss.backward()
    assert scored.loss.dtype == torch.float32
    assert torch.allclose(scored.loss, reference.loss, rtol=1e-3)
    for name, p in model.named_parameters():
        if p.grad is not None:
            scale = expected[name].abs().max().clamp(min=1e-6)
            assert ((p.grad - expected[name]).abs().max() / scale) < 0.05, name
