"""The global batch (samples per optimizer step) kept when the world changes.

``trainer.global_batch_size`` names it; each start derives the micro-batches per step from the
world it finds: ``global / (processes x data.batch_size)`` where that divides, else the nearest
count (at least 1; a tie takes the smaller, the shorter step). An elastic job that loses a node
raises the accumulation, one that gains a node lowers it, and the samples each optimizer step
averages over stay what the run was tuned for. Without it, ``trainer.accumulate_grad_batches``
holds as given and the global batch follows the world.
"""

from __future__ import annotations

from dataclasses import dataclass

from purrsight.config import Config


def accumulation_for(global_batch: int, world: int, batch: int) -> int:
    """Micro-batches per optimizer step whose global batch is nearest ``global_batch`` (>= 1)."""
    per_micro_batch = world * batch
    below = max(1, global_batch // per_micro_batch)
    above = below + 1
    return below if global_batch - below * per_micro_batch <= above * per_micro_batch - global_batch else above


@dataclass(frozen=True)
class GlobalBatch:
    world: int
    batch: int
    accumulation: int
    asked: int | None  # trainer.global_batch_size, None when unset
    configured: int | None = None  # trainer.accumulate_grad_batches as configured, when asked replaces it

    @property
    def exact(self) -> bool:
        """Whether the global batch is what was asked (or nothing was asked)."""
        return self.asked is None or self.samples == self.asked

    @property
    def samples(self) -> int:
        return self.world * self.batch * self.accumulation

    @property
    def product(self) -> str:
        """``processes x batch x accumulation = samples``: report.md's attempt table shows it."""
        return f"{self.world} x {self.batch} x {self.accumulation} = {self.samples}"

    def line(self) -> str:
        """One line for the log: the product, and how far it is from what was asked."""
        made = f"global batch {self.samples} = {self.world} processes x {self.batch} (data.batch_size) x {self.accumulation}"
        if self.asked is None:
            return f"{made} (trainer.accumulate_grad_batches)"
        unused = (
            f"; trainer.accumulate_grad_batches {self.configured} is not used"
            if self.configured not in (None, 1, self.accumulation)  # 1: the default, no choice made
            else ""
        )
        if self.samples == self.asked:
            return f"{made} micro-batches per step (trainer.global_batch_size {self.asked}){unused}"
        return (
            f"{made} micro-batches per step: the nearest to trainer.global_batch_size {self.asked}, which "
            f"{self.world} x {self.batch} does not divide{unused}"
        )


def resolve_global_batch(config: Config, world: int) -> tuple[Config, GlobalBatch]:
    """The config with the accumulation this world needs for the asked global batch, and its line."""
    asked = config.trainer.global_batch_size
    batch = config.data.micro_batch
    if asked is None:
        return config, GlobalBatch(world, batch, config.trainer.accumulate_grad_batches, None)
    accumulation = accumulation_for(asked, world, batch)
    trainer = config.trainer.model_copy(update={"accumulate_grad_batches": accumulation})
    configured = config.trainer.accumulate_grad_batches
    return config.model_copy(update={"trainer": trainer}), GlobalBatch(world, batch, accumulation, asked, configured)
