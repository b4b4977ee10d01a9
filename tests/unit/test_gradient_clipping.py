"""Gradients are clipped under every precision with a fused AdamW (Phase2Module's
configure_gradient_clipping), and 16-mixed, whose grad scaler leaves the gradients scaled until
the step, gets no fused AdamW (training/optim.py's build_optimizer).

Real parts: a Lightning Trainer of each precision on the CPU and torch's AdamW. The fused AdamW is
a GPU's: here an AdamW is marked as it marks itself (``_step_supports_amp_scaling``, which is what
Lightning's mixed-precision plugin refuses to clip for), and CUDA parameters are a CPU parameter
whose ``is_cuda`` is patched to True, as no GPU exists on this machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from purrsight.training.module import Phase2Module
from purrsight.training.optim import build_optimizer
from tests.helpers import tiny_config


def gradients_of(values: list[float]) -> list[torch.nn.Parameter]:
    parameters = [torch.nn.Parameter(torch.zeros(1)) for _ in values]
    for parameter, value in zip(parameters, values, strict=True):
        parameter.grad = torch.tensor([value])
    return parameters


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize(("algorithm", "expected"), [("norm", [0.6, 0.8]), ("value", [1.0, 1.0])])
def test_gradients_are_clipped_with_an_optimizer_that_unscales_in_its_step(
    synthetic_dir: Path, tmp_path: Path, precision: str, algorithm: str, expected: list[float]
) -> None:
    """Gradients (3, 4): norm 5, clipped to norm 1 (0.6, 0.8), or each to the value 1."""
    module = Phase2Module(tiny_config(synthetic_dir, tmp_path))
    module.trainer = pl.Trainer(precision=precision, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    parameters = gradients_of([3.0, 4.0])
    optimizer = torch.optim.AdamW(parameters)
    optimizer._step_supports_amp_scaling = True  # type: ignore[attr-defined]  # as the fused AdamW sets it
    module.configure_gradient_clipping(optimizer, 1.0, algorithm)
    assert [p.grad.item() for p in parameters] == pytest.approx(expected)  # type: ignore[union-attr]


def test_scaled_gradients_get_no_fused_step_and_true_ones_do(monkeypatch: pytest.MonkeyPatch) -> None:
    from purrsight.config import load_config
    from tests.helpers import DEFAULT_CONFIG

    monkeypatch.setattr(torch.nn.Parameter, "is_cuda", property(lambda self: True))  # no GPU here (module docstring)
    optim = load_config(DEFAULT_CONFIG, []).optim
    scaled, _ = build_optimizer(gradients_of([1.0]), optim, 10, scaled_gradients=True)
    true, _ = build_optimizer(gradients_of([1.0]), optim, 10, scaled_gradients=False)
    assert not scaled.defaults["fused"] and true.defaults["fused"]
