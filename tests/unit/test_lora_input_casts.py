"""LoRA inputs left to autocast (model/llm.py ``leave_lora_casts_to_autocast``): under a mixed
precision peft no longer copies each adapter's bf16 input to float32 (and autocast back to bf16);
the loss and the LoRA gradients stay those of peft's cast within bf16's tolerance, and nothing
changes under the precisions without autocast."""

from __future__ import annotations

import torch
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer

from purrsight.model.llm import leave_lora_casts_to_autocast
from tests import helpers


def small_lora_llm(frozen: torch.dtype) -> PeftModel:
    """Two Qwen2 layers, LoRA with dropout 0.1 on the seven projections (tests/helpers.py)."""
    return helpers.small_lora_llm(frozen, dropout=0.1)


def loss_and_lora_grads(llm: PeftModel, autocast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(3)  # the same dropout masks in both runs (bf16's and float32's draws agree)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = llm(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {name: param.grad for name, param in llm.named_parameters() if param.grad is not None}
    assert len(grads) == 2 * 7 * 2  # every A and B of both layers
    return loss.detach().float(), grads


def cast_switches(llm: PeftModel) -> set[bool]:
    return {module.cast_input_dtype_enabled for module in llm.modules() if isinstance(module, BaseTunerLayer)}


def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([grads[name].flatten() for name in sorted(grads)])


def test_under_bf16_autocast_the_loss_and_lora_gradients_match_peft_casting_within_bf16_tolerance() -> None:
    cast, left, full = small_lora_llm(torch.bfloat16), small_lora_llm(torch.bfloat16), small_lora_llm(torch.float32)
    assert leave_lora_casts_to_autocast(left, "bf16-mixed") == 2 * 7 and cast_switches(left) == {False}
    assert cast_switches(cast) == {True}
    loss_cast, grads_cast = loss_and_lora_grads(cast, autocast=True)
    loss_left, grads_left = loss_and_lora_grads(left, autocast=True)
    loss_full, grads_full = loss_and_lora_grads(full, autocast=False)  # the float32 truth, same masks
    # The same bf16 matmuls; what differs is where dropout's scale is rounded (float32 then bf16,
    # or bf16: 1/0.9 is 1.109 in bf16, 0.2% off) and the order of the gradient's casts. So both
    # runs are as far from float32 as bf16 puts them (about 1.3% here), and no farther apart.
    assert torch.allclose(loss_left, loss_cast, rtol=1e-4) and torch.allclose(loss_left, loss_full, rtol=1e-3)
    truth = flat(grads_full)
    error_cast = ((flat(grads_cast) - truth).norm() / truth.norm()).item()
    error_left = ((flat(grads_left) - truth).norm() / truth.norm()).item()
    assert error_cast < 0.03 and error_left < 1.25 * error_cast, (error_left, error_cast)
    for name, grad in grads_full.items():  # every adapter's, not only the sum's
        relative = ((grads_left[name] - grad).norm() / grad.norm()).item()
        assert grads_left[name].dtype == torch.float32 and relative < 0.05, (name, relative)


def test_without_autocast_nothing_is_switched_and_float32_is_exact() -> None:
    for precision in ("32-true", "bf16-true"):
        llm = small_lora_llm(torch.float32)
        assert leave_lora_casts_to_autocast(llm, precision) == 0 and cast_switches(llm) == {True}
    # In float32 the input already is the adapters' dtype: even switched off, not a bit changes.
    peft_casts, switched_off = small_lora_llm(torch.float32), small_lora_llm(torch.float32)
    leave_lora_casts_to_autocast(switched_off, "16-mixed")
    loss_a, grads_a = loss_and_lora_grads(peft_casts, autocast=False)
    loss_b, grads_b = loss_and_lora_grads(switched_off, autocast=False)
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(grads_a[name], grads_b[name]) for name in grads_a)
