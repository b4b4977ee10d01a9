"""``data.batch_size: auto`` and ``model.llm.gradient_checkpointing: auto``, chosen from the estimate.

The user states the global batch (``trainer.global_batch_size``: samples per optimizer step); the
device decides how it is cut. For the device training runs on (its memory: training/auto_settings.py):

- **the micro-batch** is the largest whose step the estimate (memory.py) fits in the device's
  memory, MARGIN over the estimate and HEADROOM kept free, up to the process's share of the global
  batch (global / processes); then cut even: the fewest micro-batches a step, and among those the
  one whose global batch comes nearest what was asked (a share of 64 where 50 fit is 2 x 32, not
  50 + 14, which no whole accumulation gives);
- **gradient checkpointing** is on where nothing fits without it, or where it takes strictly fewer
  micro-batches a step and a micro-batch without it is under FLOPS_WITHOUT_CHECKPOINTING of work:
  recomputation costs about a third more compute, worth it only to a GPU that small micro-batches
  leave waiting on the host;
- the accumulation follows (global_batch.py).

A value given is priced as it is (``AutoChoice.fits``); not one sample fitting a micro-batch left
auto is refused, naming the figures.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from pathlib import Path
from typing import Literal

from purrsight.config import AUTO, Config
from purrsight.errors import UserError
from purrsight.estimate.memory import HEADROOM, footprint
from purrsight.estimate.meta_model import MetaModel, meta_model
from purrsight.global_batch import accumulation_for, resolve_global_batch

# The peak measured above the estimate: 3-8% eagerly, 17% compiled (one H200, 2026-11-28,
# bench/results/gpu.md). A choice at the estimate's edge would run out of memory.
MARGIN = 1.2
# A micro-batch of this much work (6 x parameters x tokens) keeps a GPU busy for about a second of
# an H100's bf16 math, which hides the host's kernel launches (0.4 s a step at the 0.5B preset on
# an H200, bench/results/gpu.md); below it the step waits on the host (the 0.5B preset at 33k
# tokens: 13% MFU; the 7B at 8.7k: 23%), and recomputation's third more compute buys fewer,
# larger micro-batches. A 7B base reaches it at about 22k tokens, a 0.5B one at 330k.
FLOPS_WITHOUT_CHECKPOINTING = 1e15
KEPT_FREE = f"{MARGIN - 1:.0%} over it and {HEADROOM / 1e9:.0f} GB kept free"  # how every line says the margin


class NothingFitsError(UserError):
    """Not one sample's step fits the device by the estimate."""


@dataclass(frozen=True)
class AutoChoice:
    batch_size: int
    gradient_checkpointing: bool
    per_device: int  # the estimate's bytes a device at this choice
    memory: int  # the device memory it was fitted to
    device: str  # what that memory is: a GPU's name, or the host's share
    asked_batch: bool  # data.batch_size was auto
    asked_checkpointing: bool  # model.llm.gradient_checkpointing was auto
    fits: bool = True  # False: a micro-batch given that the estimate says does not fit

    def lines(self) -> list[str]:
        """What was chosen and from what, for the log's first lines."""
        room = f"the estimate {self.per_device / 1e9:.2f} GB a device, of {self.memory / 1e9:.1f} GB on {self.device}"
        said = []
        if self.asked_batch:
            said.append(f"data.batch_size auto: {self.batch_size} ({room}; {KEPT_FREE})")
        if self.asked_checkpointing:
            why = "the micro-batch needs it" if self.gradient_checkpointing else "not needed at this micro-batch"
            state = "on" if self.gradient_checkpointing else "off"
            said.append(f"model.llm.gradient_checkpointing auto: {state} ({why}{'' if self.asked_batch else '; ' + room})")
        return said

    def warning(self) -> str | None:
        """A micro-batch given that the estimate does not fit: said, not refused (the estimate may be wrong)."""
        if self.fits:
            return None
        return (
            f"data.batch_size {self.batch_size} does not fit by the estimate ({self.per_device / 1e9:.2f} GB a device, "
            f"{KEPT_FREE}, of {self.memory / 1e9:.1f} GB on "
            f"{self.device}): expect out-of-memory; data.batch_size=auto chooses one that fits"
        )


def largest_fitting(need: Callable[[int], float], budget: float, cap: int) -> int:
    """The largest micro-batch in 1..cap whose ``need`` is within ``budget``; 0: none.

    More samples never need less memory, and need grows about linearly with them (activations;
    the loss's chunk is fixed), so each guess is where the line between the bracket's ends meets
    the budget, every other one the bracket's middle: a few of the estimate's runs, not log2(cap).
    """
    if need(cap) <= budget:
        return cap
    if need(1) > budget:
        return 0
    low, high, halve = 1, cap, False  # need(low) fits, need(high) does not
    while high - low > 1:
        slope = (need(high) - need(low)) / (high - low)
        guess = (low + high) // 2 if halve or slope <= 0 else low + int((budget - need(low)) / slope)
        guess = min(high - 1, max(low + 1, guess))
        low, high = (guess, high) if need(guess) <= budget else (low, guess)
        halve = not halve
    return low


def even_micro_batch(global_batch: int, world: int, largest: int) -> int:
    """The micro-batch, at most ``largest``, whose step (global_batch.py's accumulation) comes nearest
    ``global_batch`` among those that take no more micro-batches than the fewest the memory allows
    (the share over ``largest``, rounded up); then the fewer micro-batches, then the larger one."""
    fewest = math.ceil(max(Fraction(1), Fraction(global_batch, world)) / largest)

    def made(batch: int) -> tuple[int, int, int]:
        accumulation = accumulation_for(global_batch, world, batch)
        return abs(world * batch * accumulation - global_batch), accumulation, -batch

    return min((batch for batch in range(1, largest + 1) if made(batch)[1] <= fewest), key=made)


def _need_with(need: Callable[[int, bool], float], checkpointing: bool, batch: int) -> float:
    return need(batch, checkpointing)


def choose(
    global_batch: int,
    world: int,
    sample_flops: float,
    need: Callable[[int, bool], float],
    budget: float,
    batch: int | None,
    checkpointing: bool | None,
) -> tuple[int, bool, bool]:
    """(micro-batch, checkpointing, whether it fits) for a process's share of ``global_batch``.

    ``batch`` / ``checkpointing``: the value given, or None for auto; ``sample_flops``: the
    longest sample's training work (6 x the LLM's parameters x tokens); ``need(micro_batch,
    checkpointing)``: the memory a device needs; ``budget``: what it has.
    """

    def fits(size: int, recompute: bool) -> bool:
        return need(size, recompute) <= budget

    if batch is not None:  # only checkpointing is to choose: on where the micro-batch does not fit without
        needs = checkpointing if checkpointing is not None else not fits(batch, False)
        return batch, needs, fits(batch, needs)
    cap = math.ceil(max(Fraction(1), Fraction(global_batch, world)))
    picked: dict[bool, int] = {}  # checkpointing -> the micro-batch it allows, cut even
    for option in [checkpointing] if checkpointing is not None else [False, True]:
        largest = largest_fitting(partial(_need_with, need, option), budget, cap)
        if largest:
            cut = even_micro_batch(global_batch, world, largest)  # smaller; fsdp's accumulation window may not fit
            picked[option] = cut if fits(cut, option) else largest
    if not picked:
        return 1, checkpointing is not False, False
    if len(picked) == 1:
        (option,) = picked
    else:  # recompute only for strictly fewer micro-batches a step, each of small work without it
        steps = {option: accumulation_for(global_batch, world, size) for option, size in picked.items()}
        option = steps[True] < steps[False] and picked[False] * sample_flops < FLOPS_WITHOUT_CHECKPOINTING
    return picked[option], option, True


def with_choices(config: Config, batch: int | Literal["auto"], checkpointing: bool | Literal["auto"]) -> Config:
    """``config`` with both settings set (``auto`` leaves one to choose)."""
    data = config.data.model_copy(update={"batch_size": batch})
    llm = config.model.llm.model_copy(update={"gradient_checkpointing": checkpointing})
    model = config.model.model_copy(update={"llm": llm})
    return config.model_copy(update={"data": data, "model": model})


def auto_choice(config: Config, world: int, memory: int, device: str, precision: str, llm_config: Path | None = None) -> AutoChoice:
    """The auto settings of ``config`` decided for ``world`` processes on devices of ``memory`` bytes
    (settings given are priced as they are: ``AutoChoice.fits`` says whether they fit).

    ``precision``: the one training resolves on that device (the estimate counts bf16 or fp32 by
    it; the config's may say auto). Raises NothingFitsError where a micro-batch left auto cannot
    hold one sample.
    """
    config = config.model_copy(update={"trainer": config.trainer.model_copy(update={"precision": precision})})
    given_batch = None if config.data.batch_size == AUTO else config.data.micro_batch
    given_checkpointing = None if config.model.llm.gradient_checkpointing == AUTO else config.model.llm.checkpointing
    strategy = config.distributed.strategy
    metas: dict[bool, MetaModel] = {}  # a model a checkpointing setting, priced at every micro-batch
    totals: dict[tuple[int, bool], int] = {}

    def built(checkpointing: bool) -> MetaModel:
        if checkpointing not in metas:
            metas[checkpointing] = meta_model(with_choices(config, given_batch or 1, checkpointing), llm_config)
        return metas[checkpointing]

    def total(batch: int, checkpointing: bool) -> int:
        if (batch, checkpointing) not in totals:
            priced, _ = resolve_global_batch(with_choices(config, batch, checkpointing), world)  # fsdp's window
            totals[batch, checkpointing] = (
                footprint(priced, llm_config, built(checkpointing)).estimate(world).per_gpu[strategy].total
            )
        return totals[batch, checkpointing]

    def need(batch: int, checkpointing: bool) -> float:
        return MARGIN * total(batch, checkpointing) + HEADROOM

    asked = config.trainer.global_batch_size or world * (given_batch or 1)  # none: a given micro-batch's
    llm_parameters = sum(param.numel() for param in built(bool(given_checkpointing)).model.llm.parameters())
    sample_flops = 6.0 * llm_parameters * config.data.max_length
    batch, checkpointing, fitted = choose(asked, world, sample_flops, need, memory, given_batch, given_checkpointing)
    needed = total(batch, checkpointing)
    if not fitted and given_batch is None:
        how = "with" if checkpointing else "without"
        recompute = "" if checkpointing else "recompute (model.llm.gradient_checkpointing=auto), "
        raise NothingFitsError(
            f"data.batch_size auto: not one sample fits {device} ({memory / 1e9:.1f} GB): the estimate is "
            f"{needed / 1e9:.2f} GB a device at micro-batch 1 {how} gradient checkpointing ({KEPT_FREE}); "
            f"{recompute}shard it (distributed.strategy=fsdp on more GPUs), shorten "
            "data.max_length, or give data.batch_size a number to try anyway"
        )
    return AutoChoice(batch, checkpointing, needed, memory, device, given_batch is None, given_checkpointing is None, fitted)
