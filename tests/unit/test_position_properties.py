"""The data position over the whole space of settings, through Lightning's real fit loop.

Each example trains a simulated job (tests/simulated_ranks.py: W ranks' real DataModules in one
process), stops it at a random micro-batch as a SIGTERM would (the checkpoint lands at that
step's end), and resumes it with the same or another world size, batch, accumulation and
number of loader workers. An uninterrupted run of the first shape is the reference.

Invariants (docs/DATA.md, "Resume"):
- no sample twice in an epoch, over both fits;
- fewer than one micro-batch of all ranks left out of a finished epoch (drop_last);
- an unchanged world (ranks, batch, accumulation; loader workers may differ) resumes into
  exactly the uninterrupted order: every rank's samples at every micro-batch;
- every window holds ``accumulate_grad_batches`` micro-batches except the first after the
  resume and an epoch's last, and every step's gradient is the mean over its window;
- the logged step is the optimizer step; validation runs right after an optimizer step only;
- every rank computes the same position; the job ends at ``max_steps``.
"""

from __future__ import annotations

import logging
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from purrsight.data.sampler import GlobalPositionSampler
from purrsight.runs.checkpoint_files import newest_checkpoint
from purrsight.runs.data_position import InexactPositionError, PositionError
from tests.sample_ids import SampleIds
from tests.simulated_ranks import LEGACY_LAYOUTS, WORLDLESS_LAYOUTS, Record, Shape, fit


@pytest.fixture(autouse=True)
def quiet() -> Iterator[None]:
    """Lightning's and our INFO lines at every fit would bury a failure's report."""
    logging.disable(logging.WARNING)
    yield
    logging.disable(logging.NOTSET)


@st.composite
def shapes(draw: st.DrawFn) -> Shape:
    world = draw(st.integers(1, 8))
    # Loader workers at every world size; two a rank on few ranks only (each simulated rank starts its own).
    workers = draw(st.sampled_from([0, 2] if world <= 2 else [0, 0, 1]))
    return Shape(world, draw(st.integers(1, 8)), draw(st.integers(1, 4)), workers)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Shape, Shape, int, int, int]:
    first = draw(shapes())
    if draw(st.booleans()):  # the same world, maybe other loader workers
        second = Shape(first.world, first.batch, first.accumulation, draw(st.sampled_from([0, 2] if first.world <= 2 else [0, 1])))
    else:
        second = draw(shapes())
    size = draw(st.integers(max(first.world * first.batch, second.world * second.batch), 160))
    per_epoch = -(-((size // first.world) // first.batch) // first.accumulation)  # optimizer steps in an epoch
    max_steps = draw(st.integers(1, min(3 * per_epoch + 1, 30)))
    stop_at = draw(stop_points(first, size, max_steps))
    return first, second, size, max_steps, stop_at


def stop_points(shape: Shape, size: int, max_steps: int) -> st.SearchStrategy[int]:
    """Any micro-batch up to ``max_steps``, an epoch's last one half of the time (the edge that broke)."""
    last = micro_batches_to(shape, size, max_steps)
    per_epoch = (size // shape.world) // shape.batch
    epoch_ends = [end for end in range(per_epoch, last + 1, per_epoch)]
    anywhere = st.integers(1, last)
    return st.one_of(anywhere, st.sampled_from(epoch_ends)) if epoch_ends else anywhere


def micro_batches_to(shape: Shape, size: int, steps: int) -> int:
    """Micro-batches an uninterrupted run of ``shape`` takes for ``steps`` optimizer steps."""
    per_epoch = (size // shape.world) // shape.batch
    whole, rest = divmod(steps, -(-per_epoch // shape.accumulation))
    return whole * per_epoch + min(per_epoch, rest * shape.accumulation)


def samples_by_epoch(*records: Record) -> dict[int, list[int]]:
    epochs: dict[int, list[int]] = defaultdict(list)
    for record in records:
        for epoch, _, by_rank in record.micro_batches:
            for ids in by_rank.values():
                epochs[epoch].extend(ids)
    return epochs


def check_windows(record: Record, accumulation: int, first_may_be_partial: bool, validated: list[int]) -> None:
    """Windows whole but an epoch's last (and the first after a change); each step the mean of its
    window; the logged step the optimizer step, each once and before its checkpoint; validation right
    after exactly the steps named."""
    for epoch, taken, epoch_last, first_of_fit in record.windows:
        assert 1 <= taken <= accumulation, (epoch, taken)
        partial_allowed = epoch_last or (first_of_fit and first_may_be_partial)
        assert taken == accumulation or partial_allowed, f"a window of {taken} in epoch {epoch}"
    assert max(record.gradient_errors, default=0.0) < 1e-9  # each step's gradient: the mean over its window
    assert all(step == belongs for step, belongs in record.logged), record.logged
    logged_steps = [step for step, _ in record.logged]
    assert logged_steps == sorted(set(logged_steps)), logged_steps  # each step handed to the loggers once
    # A checkpoint is written after its step's metrics reached the loggers: a kill between the two
    # left a step that the resume (starting after it) never logged.
    assert all(through is None or through == step for step, through in record.saved), record.saved
    # ... with every callback's metrics of that step (the saver writes after the last callback's hook).
    assert record.late == record.logged, (record.late, record.logged)
    assert [step for step, _ in record.validated_at] == validated
    assert not any(inside for _, inside in record.validated_at)
    assert not record.positions_disagree


def every_third(after: int, upto: int, stopped: bool) -> list[int]:
    """The steps validated in a fit from step ``after`` to ``upto`` (val_every_n_steps=3): a stop's
    own step is not validated, nor is the step a resume starts from (documented: docs/DATA.md)."""
    return [step for step in range(after + 1, upto + 1) if step % 3 == 0 and not (stopped and step == upto)]


# The shapes that broke before, run every time: (first run, resumed run, samples, max_steps, stop at micro-batch).
PAST_BUGS = [
    # feeade4/cd3cc88: an epoch-end stop with loader workers, whose iterator drew epoch 0's order again
    (Shape(2, 8, 1, 2), Shape(2, 8, 1, 2), 128, 16, 8),
    # feeade4: a resume on fewer ranks cut the later epochs short
    (Shape(2, 2, 1, 0), Shape(1, 2, 1, 0), 40, 25, 15),
    # c48ba38: a count rounded to whole steps missed the epoch's last batch after a change of world
    (Shape(2, 3, 2, 0), Shape(3, 2, 3, 0), 23, 7, 5),
    # c48ba38: a stop between a step's micro-batches, 2 loader workers (CI's SLURM requeue shape)
    (Shape(2, 2, 2, 2), Shape(2, 2, 2, 2), 37, 12, 3),
    # an epoch's last micro-batch in a short window (3 micro-batches an epoch, windows of 2 and 1)
    (Shape(2, 3, 2, 0), Shape(2, 3, 2, 0), 23, 6, 3),
    # loader workers on 8 ranks, resumed on 5 without them
    (Shape(8, 2, 2, 1), Shape(5, 3, 1, 0), 150, 10, 7),
]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.booleans())
@example(PAST_BUGS[0], False)
@example(PAST_BUGS[1], False)
@example(PAST_BUGS[2], False)
@example(PAST_BUGS[3], False)
@example(PAST_BUGS[4], False)
@example(PAST_BUGS[5], False)
@example((Shape(2, 2, 2, 2), Shape(3, 2, 1, 0), 37, 12, 5), True)  # a stop during validation, loader workers, another world
@example((Shape(2, 3, 2, 0), Shape(2, 3, 2, 0), 23, 6, 3), True)  # ... validating an epoch's last step (a short window)
def test_a_stop_anywhere_and_a_resume_on_any_world_keep_every_promise(
    scenario: tuple[Shape, Shape, int, int, int], in_validation: bool
) -> None:
    """``in_validation``: the stop arrives during the first validation pass from its micro-batch on;
    the pass ends there and the checkpoint is that validated step's."""
    check_every_promise(scenario, grouped=False, in_validation=in_validation)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_length_grouped_batches_keep_every_promise(scenario: tuple[Shape, Shape, int, int, int]) -> None:
    """data.group_by_length reorders each epoch within windows (data/sampler.py, "length-grouped batches"); the same
    promises hold through the real fit loop, and the order trained is the grouped one."""
    check_every_promise(scenario, grouped=True)


def check_every_promise(scenario: tuple[Shape, Shape, int, int, int], grouped: bool, in_validation: bool = False) -> None:
    first, second, size, max_steps, stop_at = scenario
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        before = fit(first, size, max_steps, folder / "run", stop_at=stop_at, grouped=grouped, stop_in_validation=in_validation)
        after = fit(second, size, max_steps, folder / "run", resume=True, grouped=grouped)
        reference = fit(first, size, max_steps, folder / "reference", grouped=grouped)
    if grouped:  # the uninterrupted run's first epoch is the grouped order, rank-interleaved
        order = GlobalPositionSampler(size, 1, 0, 0, np.array(SampleIds(size).lengths()), 6, 3).epoch_order()
        steps = [zip(*by_rank.values(), strict=True) for epoch, _, by_rank in reference.micro_batches if epoch == 0]
        trained = [i for step in steps for ranks in step for i in ranks]
        assert trained == order[: len(trained)]

    assert after.final_step == max_steps
    epochs = samples_by_epoch(before, after)
    for epoch, ids in epochs.items():
        assert len(ids) == len(set(ids)), f"epoch {epoch}: a sample twice"
        if epoch + 1 in epochs:  # finished: what the last world left out is less than one micro-batch of all ranks
            ended_by = second if after.resumed_in_epoch is not None and epoch >= after.resumed_in_epoch else first
            assert size - len(ids) < ended_by.world * ended_by.batch, f"epoch {epoch}: {size - len(ids)} left out"
    same_world = (first.world, first.batch, first.accumulation) == (second.world, second.batch, second.accumulation)
    check_windows(reference, first.accumulation, False, every_third(0, max_steps, False))
    if in_validation:  # the stop lands at the first validated step from its micro-batch's step on, if any
        step = next(s for s in range(1, max_steps + 1) if micro_batches_to(first, size, s) >= stop_at)
        validated = -(-step // 3) * 3
        assert (before.stopped, before.final_step) == ((True, validated) if validated <= max_steps else (False, max_steps))
        if before.stopped:  # the pass ended at its first batch; every earlier pass ran both
            assert [i for step, i in before.validation_batches if step == validated] == [0], before.validation_batches
            assert all(i in (0, 1) for _, i in before.validation_batches)
            assert len(before.validation_batches) == 2 * len(before.validated_at) - 1
    check_windows(before, first.accumulation, False, every_third(0, before.final_step, before.stopped and not in_validation))
    check_windows(after, second.accumulation, not same_world, every_third(before.final_step, max_steps, False))
    if same_world:
        assert before.micro_batches + after.micro_batches == reference.micro_batches


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("layout", LEGACY_LAYOUTS)
def test_checkpoints_of_earlier_layouts_resume_into_the_uninterrupted_order(
    layout: str, workers: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the world that saved them, each layout an earlier PurrSight wrote (simulated_ranks.LEGACY_LAYOUTS),
    saved at an epoch's last step and in the middle of one: 23 samples on 2 ranks x 3 x 2 (3
    micro-batches an epoch, windows of 2 and 1). The two that kept no world size derive it from
    their step count from epoch 1 on; in epoch 0 they are refused until PURRSIGHT_SAVED_WORLD_SIZE
    names it."""
    shape = Shape(world=2, batch=3, accumulation=2, workers=workers)
    reference = fit(shape, 23, 6, tmp_path / "reference")
    for stop_at in (3, 5):  # the first epoch's last micro-batch; the second epoch's second
        folder = tmp_path / f"stop-{stop_at}"
        before = fit(shape, 23, 6, folder, stop_at=stop_at, legacy=layout)
        if layout in WORLDLESS_LAYOUTS and stop_at == 3:
            with pytest.raises(PositionError, match="set PURRSIGHT_SAVED_WORLD_SIZE to the number of processes"):
                fit(shape, 23, 6, folder, resume=True)
            monkeypatch.setenv("PURRSIGHT_SAVED_WORLD_SIZE", "2")
        after = fit(shape, 23, 6, folder, resume=True)
        monkeypatch.delenv("PURRSIGHT_SAVED_WORLD_SIZE", raising=False)
        assert before.micro_batches + after.micro_batches == reference.micro_batches, f"stop at micro-batch {stop_at}"


@pytest.mark.parametrize("layout", WORLDLESS_LAYOUTS)
def test_a_checkpoint_that_kept_no_world_size_is_refused_on_another_world(layout: str, tmp_path: Path) -> None:
    """Its step count says which world saved it (2 ranks: 3 steps an epoch; 3 ranks: 2): a resume on
    another is one line naming the number, never a silently other sample order."""
    fit(Shape(2, 3, 2, 0), 23, 6, tmp_path, stop_at=5, legacy=layout)
    with pytest.raises(PositionError, match="its step count says 2 and this run has 3: resume it once on 2 processes"):
        fit(Shape(3, 3, 2, 0), 23, 6, tmp_path, resume=True)


def test_a_checkpoint_saved_between_a_steps_micro_batches_trains_them_again(tmp_path: Path) -> None:
    """Versions before 2026-11-25 saved a stop inside a window: the micro-batches since the last step
    (whose gradients are in no file) are trained again, into the uninterrupted order."""
    shape = Shape(world=2, batch=2, accumulation=3, workers=0)
    reference = fit(shape, 40, 6, tmp_path / "reference")  # 10 micro-batches an epoch: windows 3, 3, 3, 1
    before = fit(shape, 40, 6, tmp_path / "run", stop_at=5, legacy="mid-window")  # step 1, then 2 of step 2's 3
    after = fit(shape, 40, 6, tmp_path / "run", resume=True)
    assert len(before.micro_batches) == 5
    assert before.micro_batches[:3] + after.micro_batches == reference.micro_batches


def test_a_resume_from_an_epochs_last_step_with_loader_workers_trains_the_uninterrupted_order(tmp_path: Path) -> None:
    """The case found by hand: 128 samples, 2 ranks x 8, 2 loader workers (8 steps an epoch), the
    step-8 checkpoint. Lightning builds the loader's iterator before it moves to epoch 1, and the
    workers draw their first indices at once: they drew epoch 0's order."""
    shape = Shape(world=2, batch=8, accumulation=1, workers=2)
    before = fit(shape, 128, 16, tmp_path / "run", stop_at=8)
    after = fit(shape, 128, 16, tmp_path / "run", resume=True)
    reference = fit(shape, 128, 16, tmp_path / "reference")
    assert [epoch for epoch, _, _ in after.micro_batches] == [1] * 8
    assert before.micro_batches + after.micro_batches == reference.micro_batches


@pytest.mark.parametrize("layout", WORLDLESS_LAYOUTS)
def test_a_checkpoint_that_kept_no_world_size_saved_inside_a_window_derives_its_world(layout: str, tmp_path: Path) -> None:
    """A stop of a version before 2026-11-23 saved between a step's micro-batches: its step count
    holds only the steps before them (40 samples on 2 ranks x 2 x 3: 10 micro-batches an epoch, 4
    steps; stopped at epoch 1's fifth micro-batch, step 5). The world is derived from that count
    (rounding the window up fitted no number), and the micro-batches since step 5 train again."""
    shape = Shape(world=2, batch=2, accumulation=3, workers=0)
    reference = fit(shape, 40, 8, tmp_path / "reference")
    before = fit(shape, 40, 8, tmp_path / "run", stop_at=15, legacy=f"{layout}+mid-window")
    with pytest.raises(PositionError, match="its step count says 2 and this run has 3: resume it once on 2 processes"):
        fit(Shape(3, 2, 3, 0), 40, 8, tmp_path / "run", resume=True)
    after = fit(shape, 40, 8, tmp_path / "run", resume=True)
    assert len(before.micro_batches) == 15
    assert before.micro_batches[:13] + after.micro_batches == reference.micro_batches


@pytest.mark.parametrize("max_steps", [5, 6])  # inside epoch 2 (2 of its 3 micro-batches), and at its end
@pytest.mark.parametrize("layout", [*WORLDLESS_LAYOUTS, "sampler-state"])
def test_a_last_step_saved_after_lightning_closed_its_epoch_resumes_inside_that_epoch(
    layout: str, max_steps: int, tmp_path: Path
) -> None:
    """Before feeade4 (2026-11-23) the last step was saved in on_train_end, where Lightning had
    counted its epoch as completed: a resume with a larger trainer.max_steps started the next
    epoch, and a checkpoint that kept no world size was refused naming a wrong number. 23 samples
    on 2 ranks x 3 x 2 (3 micro-batches an epoch, 2 steps); the resume trains to step 8 in the
    uninterrupted order."""
    shape = Shape(world=2, batch=3, accumulation=2, workers=0)
    reference = fit(shape, 23, 8, tmp_path / "reference")
    before = fit(shape, 23, max_steps, tmp_path / "run", legacy=f"{layout}+train-end")
    after = fit(shape, 23, 8, tmp_path / "run", resume=True)
    assert before.micro_batches + after.micro_batches == reference.micro_batches


def test_a_loader_workers_checkpoint_whose_epoch_changed_world_is_refused_or_starts_the_next_epoch(tmp_path: Path) -> None:
    """The worker-snapshot layout (before 2026-11-25) places its position by the fit loop's batch
    count, in the saving world's units: exact when the step count is that world's, which the
    resume checks. A count that is not (here: the step count moved by one, as after a change of
    world inside the epoch) is refused with one line naming data.on_data_change, and with
    next_epoch the run starts the next epoch at sample 0, in the uninterrupted run's order."""
    shape = Shape(world=2, batch=3, accumulation=2, workers=0)
    reference = fit(shape, 23, 8, tmp_path / "reference")
    fit(shape, 23, 8, tmp_path / "run", stop_at=5, legacy="sampler-snapshot")  # epoch 1, step 4
    path, _ = newest_checkpoint(tmp_path / "run" / "checkpoints")
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["global_step"] += 1
    torch.save(checkpoint, path)
    with pytest.raises(InexactPositionError, match=r"during epoch 1: .* set data.on_data_change=next_epoch to start epoch 2 at"):
        fit(shape, 23, 8, tmp_path / "run", resume=True)
    after = fit(shape, 23, 8, tmp_path / "run", resume=True, overrides=("data.on_data_change=next_epoch",))
    epoch_2 = [batch for batch in reference.micro_batches if batch[0] == 2]
    assert after.micro_batches[: len(epoch_2)] == epoch_2


@pytest.mark.parametrize("layout", [None, "no-loader-state"])
def test_a_second_resume_after_a_stop_at_an_epochs_end_trains_the_uninterrupted_order(
    layout: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a resume from an epoch's last step Lightning keeps its epoch counters equal for the rest
    of the run, as a save after a closed epoch has them: a later checkpoint is no closed epoch.
    40 samples on 2 ranks x 2 (10 steps an epoch): stopped at step 10, then at 14, then to 25 (the
    layout without a world size is told it: in epoch 0 its step count cannot)."""
    monkeypatch.setenv("PURRSIGHT_SAVED_WORLD_SIZE", "2")
    shape = Shape(world=2, batch=2, accumulation=1, workers=0)
    reference = fit(shape, 40, 25, tmp_path / "reference")
    first = fit(shape, 40, 25, tmp_path / "run", stop_at=10, legacy=layout)
    second = fit(shape, 40, 25, tmp_path / "run", resume=True, stop_at=4, legacy=layout)
    last = fit(shape, 40, 25, tmp_path / "run", resume=True)
    assert (first.final_step, second.final_step) == (10, 14)
    assert first.micro_batches + second.micro_batches + last.micro_batches == reference.micro_batches


def test_a_last_step_saved_after_its_epoch_closed_in_a_resumed_run_resumes_inside_that_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a run resumed from an epoch's last step, Lightning counts a closed epoch's processed and
    completed one past its ready and started: an on_train_end save there (before feeade4) is a
    closed epoch too. 40 samples on 2 ranks x 2: stopped at step 10, resumed to max_steps 14 (saved
    at train end), then to 25."""
    monkeypatch.setenv("PURRSIGHT_SAVED_WORLD_SIZE", "2")
    shape = Shape(world=2, batch=2, accumulation=1, workers=0)
    reference = fit(shape, 40, 25, tmp_path / "reference")
    first = fit(shape, 40, 25, tmp_path / "run", stop_at=10, legacy="no-loader-state")
    second = fit(shape, 40, 14, tmp_path / "run", resume=True, legacy="no-loader-state+train-end")
    last = fit(shape, 40, 25, tmp_path / "run", resume=True)
    assert (first.final_step, second.final_step) == (10, 14)
    assert first.micro_batches + second.micro_batches + last.micro_batches == reference.micro_batches
