"""``data.batch_size: auto`` and ``model.llm.gradient_checkpointing: auto`` (purrsight/estimate/auto_fit.py,
purrsight/training/auto_settings.py): the search's promises over all numbers, the choice against the
model's own estimate, and what a resume keeps. End to end: tests/integration/test_auto_settings.py."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from purrsight.config import ConfigError, dump_config, load_config
from purrsight.estimate.auto_fit import (
    FLOPS_WITHOUT_CHECKPOINTING,
    HEADROOM,
    MARGIN,
    NothingFitsError,
    auto_choice,
    choose,
    even_micro_batch,
    largest_fitting,
    with_choices,
)
from purrsight.estimate.memory import footprint
from purrsight.global_batch import accumulation_for
from purrsight.training import auto_settings
from purrsight.training.auto_settings import BATCH, CHECKPOINTING, _decide, device_memory, host_memory, kept_settings
from tests.helpers import DEFAULT_CONFIG, REPO, tiny_config, tiny_overrides

costs = st.integers(min_value=0, max_value=10**6)


@given(fixed=costs, slope=costs, bend=st.integers(min_value=1, max_value=300), steeper=costs, budget=st.integers(0, 10**9))
@example(fixed=0, slope=1, bend=1, steeper=0, budget=0)
def test_the_search_finds_the_largest_micro_batch_within_the_budget(
    fixed: int, slope: int, bend: int, steeper: int, budget: int
) -> None:
    """Need grows with the micro-batch, linearly with a bend (where activations overtake the loss's
    fixed chunk): the search's answer is the brute force's, for every cap."""

    def need(batch: int) -> float:
        return fixed + slope * batch + steeper * max(0, batch - bend)

    for cap in (1, 7, 64, 300):
        fitting = [batch for batch in range(1, cap + 1) if need(batch) <= budget]
        assert largest_fitting(need, budget, cap) == max(fitting, default=0)


@given(global_batch=st.integers(1, 4096), world=st.integers(1, 64), largest=st.integers(1, 512))
@example(global_batch=64, world=1, largest=50)  # 2 x 32, not 50 + 14
@example(global_batch=202, world=2, largest=50)  # a share of 101, prime: 2 x 50 (200), not 101 x 1
@example(global_batch=97, world=2, largest=6)  # 8 x 6 (96): the mean, 5, would take 10 (100)
def test_the_micro_batch_takes_the_fewest_micro_batches_and_the_nearest_global_batch(
    global_batch: int, world: int, largest: int
) -> None:
    """No micro-batch within the memory reaches the global batch in fewer micro-batches, and none
    with as few comes nearer to it (global_batch.py's accumulation makes the step)."""
    share = max(Fraction(1), Fraction(global_batch, world))
    batch = even_micro_batch(global_batch, world, largest)
    assert 1 <= batch <= largest
    fewest = math.ceil(share / largest)
    accumulation = accumulation_for(global_batch, world, batch)
    assert accumulation <= fewest
    made = abs(world * batch * accumulation - global_batch)
    for other in range(1, largest + 1):
        if accumulation_for(global_batch, world, other) <= fewest:
            assert made <= abs(world * other * accumulation_for(global_batch, world, other) - global_batch), other
    if global_batch % world == 0 and (global_batch // world) % fewest == 0:
        assert world * batch * accumulation == global_batch  # whole micro-batches fill it exactly


@given(
    share=st.integers(1, 512),
    sample_flops=st.sampled_from([1e9, 3e12, 5e13, 1e16]),
    fixed=st.integers(0, 10**4),
    off_slope=st.integers(1, 10**3),
    on_fraction=st.integers(1, 100),
    budget=st.integers(0, 10**6),
)
def test_checkpointing_is_on_only_where_the_micro_batch_needs_it(
    share: int, sample_flops: float, fixed: int, off_slope: int, on_fraction: int, budget: int
) -> None:
    """Recomputation holds less a sample (``on_fraction`` percent of it); it is chosen only where
    without it nothing fits, or where it takes strictly fewer micro-batches a step than the
    micro-batch without it, which is under the work's floor; every choice fits and is the even cut
    of the largest that fits."""

    def need(batch: int, checkpointing: bool) -> float:
        return fixed + batch * (off_slope * on_fraction / 100 if checkpointing else off_slope)

    batch, checkpointing, fits = choose(share, 1, sample_flops, need, budget, None, None)
    off = max((b for b in range(1, share + 1) if need(b, False) <= budget), default=0)
    on = max((b for b in range(1, share + 1) if need(b, True) <= budget), default=0)
    assert fits == (max(off, on) > 0)
    if fits:
        assert need(batch, checkpointing) <= budget and batch <= share
        assert batch == even_micro_batch(share, 1, on if checkpointing else off)
    if checkpointing and off > 0:
        off_batch = even_micro_batch(share, 1, off)
        assert accumulation_for(share, 1, batch) < accumulation_for(share, 1, off_batch)  # strictly fewer steps
        assert off_batch * sample_flops < FLOPS_WITHOUT_CHECKPOINTING
    if not checkpointing:
        assert off > 0
    # A value given wins: the micro-batch stays, and checkpointing is on only where it must be.
    given_batch, needed, _ = choose(share, 1, sample_flops, need, budget, 3, None)
    assert given_batch == 3 and needed == (need(3, False) > budget)
    assert choose(share, 1, sample_flops, need, budget, None, True)[1] is True


def test_the_choice_is_the_largest_the_models_own_estimate_fits(synthetic_dir: Path, tmp_path: Path) -> None:
    """The tiny default at a memory that holds some micro-batches, not the share: the chosen one's
    estimate (x MARGIN + HEADROOM) fits, the next one's does not; too little memory for one sample
    is refused naming the figures."""
    config = tiny_config(
        synthetic_dir, tmp_path, data__batch_size="auto", trainer__global_batch_size=500, data__max_length=48,
        model__llm__gradient_checkpointing="false",
    )  # fmt: skip

    def need(batch: int) -> float:
        priced = config.model_copy(update={"data": config.data.model_copy(update={"batch_size": batch})})
        return MARGIN * footprint(priced).estimate(1).per_gpu["ddp"].total + HEADROOM

    memory = int((need(60) + need(61)) / 2)  # between 60 and 61 samples: the largest is 60
    choice = auto_choice(config, 1, memory, "a test's budget", "bf16-mixed")
    assert choice.gradient_checkpointing is False  # given: kept
    assert choice.batch_size == even_micro_batch(500, 1, 60) == 56  # 9 x 56 = 504: no 9 or fewer make 500
    assert need(choice.batch_size) <= memory < need(61)
    assert choice.lines() == [
        f"data.batch_size auto: 56 (the estimate {choice.per_device / 1e9:.2f} GB a device, of {memory / 1e9:.1f} GB on "
        "a test's budget; 20% over it and 2 GB kept free)"
    ]
    refusal = r"not one sample fits a test's budget \(2\.0 GB\).*micro-batch 1 without gradient checkpointing.*recompute"
    with pytest.raises(NothingFitsError, match=refusal):
        auto_choice(config, 1, HEADROOM, "a test's budget", "bf16-mixed")
    # A micro-batch given is priced, not refused: checkpointing comes on, and where even that does
    # not fit, a warning says so (the estimate may be wrong; the user chose).
    given = with_choices(config, 61, "auto")
    warned = auto_choice(given, 1, memory, "a test's budget", "bf16-mixed")
    assert (warned.batch_size, warned.gradient_checkpointing) == (61, True)
    assert warned.fits and warned.warning() is None  # recomputation makes room for the 61st sample
    tiny = auto_choice(given, 1, HEADROOM, "a test's budget", "bf16-mixed")
    assert not tiny.fits and (tiny.warning() or "").startswith("data.batch_size 61 does not fit by the estimate")


def test_auto_needs_a_global_batch_and_bad_values_are_one_problem_each() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(DEFAULT_CONFIG, ["data.batch_size=auto"], check_paths=False)
    assert caught.value.problems == [
        "override data.batch_size=auto: config: data.batch_size=auto needs trainer.global_batch_size (samples per optimizer step) "
        "to fill; set it, or give data.batch_size a number"
    ]
    with pytest.raises(ConfigError) as caught:
        load_config(DEFAULT_CONFIG, ["data.batch_size=0", "model.llm.gradient_checkpointing=sometimes"], check_paths=False)
    assert [problem.split(": ", 2)[1:] for problem in caught.value.problems] == [
        ["model.llm.gradient_checkpointing", "give true, false or auto (got 'sometimes')"],
        ["data.batch_size", "Input should be greater than 0 (a whole number of samples), or auto (got 0)"],
    ]


def saved(
    batch: object = 6,
    checkpointing: object = False,
    global_batch: int | None = 12,
    chosen: tuple[str, ...] = (BATCH, CHECKPOINTING),
):
    values = {
        "data": {"batch_size": batch, "max_length": 64},
        "model": {"llm": {"gradient_checkpointing": checkpointing}},
        "trainer": {"global_batch_size": global_batch},
    }
    return values, frozenset(chosen)


@given(batch=st.integers(1, 40), global_batch=st.integers(1, 200))
def test_a_resume_keeps_its_runs_own_choices_for_what_it_still_asks(batch: int, global_batch: int) -> None:
    config = load_config(
        DEFAULT_CONFIG,
        ["data.batch_size=auto", "model.llm.gradient_checkpointing=auto", f"trainer.global_batch_size={global_batch}"],
        check_paths=False,
    )
    assert kept_settings(config, saved(batch, True, global_batch)) == {BATCH: batch, CHECKPOINTING: True}
    # Another global batch or length: chosen again; values the run was given (not chosen): chosen now.
    assert kept_settings(config, saved(batch, True, global_batch + 1)) == {}
    assert kept_settings(config, saved(batch, True, global_batch, chosen=())) == {}
    # A value given now wins over the checkpoint's.
    given_now = config.model_copy(update={"data": config.data.model_copy(update={"batch_size": 4})})
    assert kept_settings(given_now, saved(batch, True, global_batch)) == {CHECKPOINTING: True}


@pytest.mark.parametrize(
    ("bad", "unread"),
    [
        (saved(batch=True), BATCH),
        (saved(batch="auto"), BATCH),
        (saved(checkpointing="auto"), CHECKPOINTING),
        (({"data": []}, frozenset()), BATCH),
    ],
)
def test_a_setting_a_checkpoint_holds_that_does_not_read_is_chosen_again(
    bad: tuple[dict[str, object], frozenset[str]], unread: str
) -> None:
    config = load_config(
        DEFAULT_CONFIG,
        ["data.batch_size=auto", "model.llm.gradient_checkpointing=auto", "trainer.global_batch_size=12"],
        check_paths=False,
    )
    kept = kept_settings(config, bad)  # type: ignore[arg-type]
    assert unread not in kept and len(kept) <= 1


def test_the_estimate_prices_auto_as_training_chooses_it(synthetic_dir: Path, tmp_path: Path) -> None:
    """``train_phase2.py estimate`` names the choice for --gpu-memory; where nothing fits, it says
    training's refusal in one line and prices micro-batch 1 with checkpointing, which does not fit."""
    overrides = tiny_overrides(
        synthetic_dir, tmp_path, data__batch_size="auto", trainer__global_batch_size=24, model__llm__gradient_checkpointing="auto"
    )
    command = [sys.executable, "train_phase2.py", "estimate", "--config", str(DEFAULT_CONFIG), "--gpu-memory", "80GB", *overrides]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "data.batch_size auto: 24 (the estimate" in done.stdout and "on a 80 GB GPU" in done.stdout
    assert "model.llm.gradient_checkpointing auto: off (not needed at this micro-batch)" in done.stdout
    command[command.index("80GB")] = "2GB"
    refused = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    assert refused.returncode == 0, refused.stderr
    (said,) = [line for line in refused.stdout.splitlines() if "not one sample fits" in line]
    assert said.startswith("data.batch_size auto: not one sample fits a 2 GB GPU (2.0 GB)")
    assert said.endswith("(training stops at start; priced below at micro-batch 1)")
    # The table's verdict for ddp at that micro-batch: not "fits" (2 GB kept free is all of the GPU).
    assert re.search(r"^in 2000\.00 MB +(tight|DOES NOT FIT) ", refused.stdout, re.MULTILINE), refused.stdout


def test_a_resume_cuts_the_kept_micro_batch_for_its_world_and_chooses_again_where_it_no_longer_fits(
    synthetic_dir: Path, tmp_path: Path
) -> None:
    """_decide against checkpoint files as the trainer writes them (the config's YAML, ``auto_chosen``),
    on the tiny model's own estimate: a run that chose 6 a process on 2 processes (global batch 12)
    keeps 6 on one (2 micro-batches), is cut to 3 on four, is chosen again where 6 no longer fits
    the device, and a checkpoint from before ``auto_chosen`` (its values were given) keeps nothing."""
    config = tiny_config(
        synthetic_dir, tmp_path, data__batch_size="auto", model__llm__gradient_checkpointing="auto", trainer__global_batch_size=12
    )
    ran = with_choices(config, 6, False)

    def checkpoint(name: str, chosen: list[str] | None) -> Path:
        meta: dict[str, object] = {"config": dump_config(ran)}
        if chosen is not None:
            meta["auto_chosen"] = chosen
        path = tmp_path / name
        torch.save({"purrsight": meta, "state_dict": {}, "global_step": 4}, path)
        return path

    new = checkpoint("new.ckpt", [BATCH, CHECKPOINTING])
    roomy = 10**12
    one = _decide(config, new, "cpu", 1, roomy, "a test's budget")
    assert (one.batch, one.checkpointing) == (6, False)
    assert one.lines == [
        "data.batch_size auto: 6, as the checkpoint's run chose it (give a value to choose again)",
        "model.llm.gradient_checkpointing auto: off, as the checkpoint's run chose it (give a value to choose again)",
    ]
    four = _decide(config, new, "cpu", 4, roomy, "a test's budget")
    assert four.batch == 3 and four.lines[0].startswith("data.batch_size auto: 3, the checkpoint run's 6 cut for 4 processes")

    def need(batch: int, checkpointing: bool = False) -> float:
        return MARGIN * footprint(with_choices(config, batch, checkpointing)).estimate(1).per_gpu["ddp"].total + HEADROOM

    tight = int((need(4) + need(5)) / 2)  # 4 samples fit without checkpointing, 5 do not: nor does the kept 6
    again = _decide(config, new, "cpu", 1, tight, "a test's budget")
    assert again.lines[0].startswith(
        "the checkpoint's run chose data.batch_size 6, model.llm.gradient_checkpointing off: it does not fit"
    )
    assert again.lines[0].endswith("chosen again") and need(again.batch, again.checkpointing) <= tight
    old = _decide(config, checkpoint("old.ckpt", None), "cpu", 1, roomy, "a test's budget")
    assert old.batch == 12 and not any("the checkpoint" in line for line in old.lines)


def test_a_cpu_device_is_the_hosts_available_memory_within_the_jobs_cgroup_shared_by_the_nodes_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < host_memory() <= total
    if host_memory() <= 2 * 10**9:
        pytest.skip("under 2 GB available here: the limit below would not bind")
    monkeypatch.setattr(auto_settings, "memory_limit", lambda: 10**9)  # a job's 1 GB, as launcher/cgroups.py reads it
    assert host_memory() == 10**9
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert device_memory("cpu") == (10**9 // 4, "host memory / 4 processes")
