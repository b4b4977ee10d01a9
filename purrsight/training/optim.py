"""AdamW over the trainable parameters with linear warmup and a cosine decay.

The schedule is an object (``LRSchedule``), not a closure: torch's LambdaLR saves a callable
object's attributes in the checkpoint and restores them on resume. So a resumed run knows the
schedule it was on, and when the config now asks for another one (``trainer.max_steps``,
``optim.lr``, ``optim.warmup_steps`` or ``optim.min_lr_ratio`` changed), ``continue_schedule``
joins the two: from the resumed step the LR starts where it was and follows the rest of the
cosine, rescaled to the new end, instead of jumping to where a fresh schedule would be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from purrsight.config import Config, OptimConfig


def warmup_cosine(step: int, warmup: int, total: int, floor: float) -> float:
    """LR multiplier: linear 0 -> 1 over ``warmup`` steps, then cosine 1 -> ``floor`` at ``total``."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class LRSchedule:
    """The LR multiplier of each optimizer step, relative to ``lr``; plain numbers only (saved in checkpoints).

    Fresh (``start_lr`` None): warmup then cosine to ``floor * lr`` at ``total``. Continued
    (after a resume that changed the target): from ``start`` at ``start_lr``, the cosine from
    the progress the earlier schedule had reached (``start_progress``) down to the new floor at
    the new ``total``; still in warmup, a straight line from ``start_lr`` up to ``lr``.
    """

    lr: float
    warmup: int
    total: int
    floor: float
    start: int = 0
    start_lr: float | None = None
    start_progress: float = 0.0

    def __call__(self, step: int) -> float:
        return self.lr_at(step) / self.lr

    def target(self) -> tuple[float, int, int, float]:
        return (self.lr, self.warmup, self.total, self.floor)

    def lr_at(self, step: int) -> float:
        if self.start_lr is None or (self.start < self.warmup <= step):
            return self.lr * warmup_cosine(step, self.warmup, self.total, self.floor)
        if step < self.warmup:
            return self.start_lr + (self.lr - self.start_lr) * (step - self.start) / max(1, self.warmup - self.start)
        end = self.lr * self.floor
        progress = self.progress(step)
        at_start = 1 + math.cos(math.pi * self.start_progress)
        if at_start < 1e-6:  # the earlier schedule had finished its decay: a fresh half cosine to the new end
            fraction = min(1.0, (step - self.start) / max(1, self.total - self.start))
            return end + (self.start_lr - end) * 0.5 * (1 + math.cos(math.pi * fraction))
        return end + (self.start_lr - end) * (1 + math.cos(math.pi * progress)) / at_start

    def progress(self, step: int) -> float:
        """How far along its cosine this schedule is at ``step`` (0 in warmup, 1 at its end)."""
        if self.start_lr is None or self.start < self.warmup:
            return 0.0 if step < self.warmup else min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        fraction = min(1.0, (step - self.start) / max(1, self.total - self.start))
        return self.start_progress + (1 - self.start_progress) * fraction


def schedule_for(optim: OptimConfig, total_steps: int) -> LRSchedule:
    return LRSchedule(optim.lr, optim.warmup_steps, total_steps, optim.min_lr_ratio)


def build_optimizer(
    parameters: list[torch.nn.Parameter], optim: OptimConfig, total_steps: int, scaled_gradients: bool = False
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer and its per-step schedule (step the scheduler after every optimizer step).

    ``scaled_gradients``: a grad scaler multiplies the loss (16-mixed).
    """
    beta1, beta2 = optim.betas
    # On GPUs the fused kernel: one launch for all parameters, and its step counters stay on
    # the device (the default keeps them on the host and reads each one per step). Not under a
    # grad scaler: the fused step unscales inside itself, after clipping would have seen the
    # gradients still scaled (Lightning refuses to clip then).
    fused = bool(parameters) and all(p.is_cuda for p in parameters) and not scaled_gradients
    optimizer = torch.optim.AdamW(
        parameters, lr=optim.lr, betas=(beta1, beta2), weight_decay=optim.weight_decay, fused=fused or None
    )
    optimizer.register_load_state_dict_post_hook(own_loaded_state)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_for(optim, total_steps))
    return optimizer, scheduler


def own_loaded_state(optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer.load_state_dict``: its CPU tensors copied out of the checkpoint file.

    A resume memory-maps the checkpoint (runs/checkpoint_saver.py), and ``load_state_dict`` keeps a
    tensor that already has its parameter's device and dtype as it is: on a CPU the moments would
    stay views of the mapped file for the rest of the run, the file kept mapped after ``keep_last``
    removes it (its disk space held; on NFS a ``.nfs*`` file in the folder). FSDP's sharded states
    (DTensors) are fresh copies already; on a GPU every state was copied to the device.
    """
    for state in optimizer.state.values():
        for name, value in state.items():
            if type(value) is torch.Tensor and value.device.type == "cpu":
                state[name] = value.clone()


CHANGES = (("optim.lr", 0), ("optim.warmup_steps", 1), ("trainer.max_steps", 2), ("optim.min_lr_ratio", 3))


def continue_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, config: Config, step: int) -> list[str]:
    """After a resume at ``step``: join the restored schedule to the one ``config`` asks for; what changed, one line each.

    Nothing changes when the restored schedule has the config's target (a plain resume, or a
    second resume after a change: the continuation is restored as it was saved).
    """
    restored = scheduler.lr_lambdas[0]
    wanted = schedule_for(config.optim, config.trainer.max_steps)
    if not isinstance(restored, LRSchedule) or restored.target() == wanted.target():
        return []
    lr_now = restored.lr_at(step)
    continued = LRSchedule(*wanted.target(), start=step, start_lr=lr_now, start_progress=restored.progress(step))
    scheduler.lr_lambdas[0] = continued
    scheduler.base_lrs = [wanted.lr for _ in scheduler.base_lrs]
    for group in scheduler.optimizer.param_groups:  # the joined schedule starts at lr_now by construction
        group["lr"], group["initial_lr"] = lr_now, wanted.lr
    scheduler._last_lr = [lr_now for _ in scheduler.base_lrs]  # what get_last_lr() reports
    lines = []
    for name, index in CHANGES:
        before, after = restored.target()[index], wanted.target()[index]
        if before != after:
            lines.append(f"{name} {before:g} -> {after:g}")
    end = f"cosine decay now ends at step {wanted.total} at {wanted.lr * wanted.floor:.3g}"
    return [f"{', '.join(lines)}: the learning rate continues from {lr_now:.3g} at step {step}; {end}"]
