"""LoRA adapters' compute copies (model/lora_compute_copies.py): under autocast every adapter is
cast to bf16 in one op a micro-batch instead of at each use, bit-identically; the copies are used
only between ``refresh`` and ``release``; nothing changes without a mixed precision."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import PeftModel
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from purrsight.model.llm import leave_lora_casts_to_autocast
from purrsight.model.lora_compute_copies import AdapterComputeCopies, AdapterLinear, use_adapter_compute_copies
from tests import helpers

ADAPTERS = 2 * 7 * 2  # two layers, seven projections, A and B
VOCAB = 64


def small_lora_llm(*, use_dora: bool = False) -> PeftModel:
    """Two Qwen2 layers in bf16 with LoRA (tests/helpers.py), the inputs left to autocast as the
    trainer leaves them; no dropout, so runs draw no random numbers."""
    llm = helpers.small_lora_llm(torch.bfloat16, dropout=0.0, use_dora=use_dora)
    leave_lora_casts_to_autocast(llm, "bf16-mixed")
    return llm


def with_copies(length: int) -> tuple[PeftModel, AdapterComputeCopies, torch.Tensor]:
    """The small model with its compute copies installed, and a row of ``length`` token ids."""
    llm = small_lora_llm()
    copies = use_adapter_compute_copies(llm, "bf16-mixed")
    assert copies is not None
    return llm, copies, torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(0))


def accumulate(
    llm: PeftModel, copies: AdapterComputeCopies | None, batches: list[torch.Tensor]
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The losses of ``batches`` as micro-batches of one optimizer step, and the LoRA gradients
    they accumulate; with ``copies``, refreshed and released around each as the trainer does."""
    losses = []
    for ids in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if copies is not None:
                copies.refresh("cpu")
            loss = llm(input_ids=ids, labels=ids).loss
        loss.backward()  # outside autocast, as Lightning calls it; the recomputation reads the copies
        if copies is not None:
            copies.release()
        losses.append(loss.item())
    return losses, {name: param.grad.clone() for name, param in llm.named_parameters() if param.grad is not None}


@settings(max_examples=8, deadline=None)
@given(
    rows=st.integers(1, 3),
    lengths=st.lists(st.integers(2, 13), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_a_step_with_compute_copies_is_bit_identical_to_autocasts_casts(rows: int, lengths: list[int], seed: int) -> None:
    """Any number of micro-batches of any length: the same bf16 values into the same matmuls and
    the same gradients cast to float32 and accumulated, so every loss and gradient is equal."""
    generator = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, VOCAB, (rows, length), generator=generator) for length in lengths]
    plain, copied = small_lora_llm(), small_lora_llm()
    copies = use_adapter_compute_copies(copied, "bf16-mixed")
    assert copies is not None and [len(group) for group in copies.groups] == [ADAPTERS // 2] * 2
    losses_plain, grads_plain = accumulate(plain, None, batches)
    losses_copied, grads_copied = accumulate(copied, copies, batches)
    assert losses_copied == losses_plain
    assert len(grads_copied) == ADAPTERS and grads_copied.keys() == grads_plain.keys()
    for name, grad in grads_plain.items():
        assert grads_copied[name].dtype == torch.float32 and torch.equal(grads_copied[name], grad), name


class CountCopies(TorchDispatchMode):
    """Counts the casts (``_to_copy``) of tensors shaped as an adapter, and the list copies."""

    def __init__(self, shapes: set[torch.Size]) -> None:
        super().__init__()
        self.shapes, self.adapter_casts, self.list_copies = shapes, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._to_copy.default and args[0].shape in self.shapes:
            self.adapter_casts += 1
        if func is torch.ops.aten._foreach_copy_.default:
            self.list_copies += 1
        return func(*args, **(kwargs or {}))


def test_one_micro_batch_casts_the_adapters_in_two_list_copies_not_three_casts_each() -> None:
    """autocast's way: each adapter cast in the forward, again in checkpointing's recomputation,
    and its gradient cast back (3 x 28 here). The copies: one list copy each way, no cast."""
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    counts = {}
    for with_copies in (False, True):
        llm = small_lora_llm()
        copies = use_adapter_compute_copies(llm, "bf16-mixed") if with_copies else None
        shapes = {p.shape for n, p in llm.named_parameters() if ".lora_" in n}
        with CountCopies(shapes) as counted:
            accumulate(llm, copies, [ids])
        counts[with_copies] = (counted.adapter_casts, counted.list_copies)
    assert counts[False] == (3 * ADAPTERS, 0)
    assert counts[True] == (0, 2 * 2)  # one list copy a decoder layer each way (DDP overlaps their all-reduce)


def test_outside_refresh_and_release_the_layers_use_their_own_weights() -> None:
    """A forward after ``release`` (or with none refreshed, or outside autocast) reads the weights
    as they are now: copies made before an optimizer step are never used after it."""
    llm, copies, ids = with_copies(7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        copies.refresh("cpu")
        assert copies.current == [None] * ADAPTERS  # each layer's made as it begins
        llm(input_ids=ids, labels=ids).loss.backward()
        stale = list(copies.current)
    copies.release()
    torch.optim.SGD([p for p in llm.parameters() if p.requires_grad], lr=1.0).step()  # the weights move
    assert copies.current is None and all(copy is not None for copy in stale)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        after = llm(input_ids=ids, labels=ids).loss
        copies.refresh("cpu")  # fresh copies of the moved weights: the same loss
        refreshed = llm(input_ids=ids, labels=ids).loss
        fresh = copies.current
    assert fresh is not None and all(not torch.equal(a, b) for a, b in zip(fresh, stale, strict=True))  # type: ignore[arg-type]
    assert torch.equal(after, refreshed)
    copies.refresh("cpu")  # outside autocast: nothing to copy into, the weights are used
    assert copies.current is None


def test_copies_made_under_inference_mode_carry_no_graph_and_the_next_refresh_does() -> None:
    """Validation (inference mode) between training micro-batches: its copies are inference tensors;
    the training forward after it refreshes, and the gradients reach the float32 weights."""
    llm, copies, ids = with_copies(5)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        copies.refresh("cpu")
        llm(input_ids=ids, labels=ids)
        assert copies.current is not None and copies.current[0].grad_fn is None
    copies.release()
    _, grads = accumulate(llm, copies, [ids])
    assert len(grads) == ADAPTERS and all(grad.abs().sum() > 0 for grad in grads.values())


def test_switched_in_place_keeping_names_and_nothing_without_a_mixed_precision() -> None:
    llm = small_lora_llm()
    names = list(llm.state_dict())
    assert use_adapter_compute_copies(llm, "32-true") is None and use_adapter_compute_copies(llm, "bf16-true") is None
    assert not any(isinstance(m, AdapterLinear) for m in llm.modules())
    copies = use_adapter_compute_copies(llm, "16-mixed")
    assert copies is not None
    switched = [m for m in llm.modules() if isinstance(m, AdapterLinear)]
    assert len(switched) == ADAPTERS and all(isinstance(m, nn.Linear) for m in switched)
    assert list(llm.state_dict()) == names  # checkpoints load either way


def test_dora_adapters_read_their_weights_themselves_and_are_left_alone() -> None:
    """peft's DoRA variant reads lora_A and lora_B's weights directly, not through their forward."""
    assert use_adapter_compute_copies(small_lora_llm(use_dora=True), "bf16-mixed") is None


def test_a_layers_adapter_gradients_are_ready_before_the_layer_below_is_recomputed() -> None:
    """One group a decoder layer: the top layer's adapters get their float32 gradients (where DDP's
    hooks start their all-reduce) before backward reaches the layer below, as with autocast's own
    casts; one group for the model would hold them all until the end of backward."""
    llm = small_lora_llm()
    copies = use_adapter_compute_copies(llm, "bf16-mixed")
    assert copies is not None
    events: list[str] = []
    bottom, top = copies.groups
    for name, group in (("bottom", bottom), ("top", top)):
        for adapter in group:
            adapter.weight.register_post_accumulate_grad_hook(lambda _, name=name: events.append(f"{name} gradient"))
    bottom[0].register_forward_hook(lambda *_: events.append("bottom runs"))
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    accumulate(llm, copies, [ids])
    backward = events[events.index("bottom runs") + 1 :]  # after the forward's own run: the recomputation on
    assert backward.index("bottom runs") > max(i for i, event in enumerate(backward) if event == "top gradient")
    assert backward.count("top gradient") == backward.count("bottom gradient") == ADAPTERS // 2


def test_the_trainer_under_bf16_mixed_trains_bit_identically_with_the_copies(
    synthetic_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real trainer, as a user runs it: bf16-mixed, gradient checkpointing, LoRA dropout, 3
    micro-batches a step over a pass of 16 (the first pass ends in a window of one, and 7 steps
    run into the second), validation passes between steps (copies made without a graph, under
    no_grad on CPU, then training's again). With the copies and without,
    the same checkpoint to the bit."""
    import purrsight.training.module as trainer_module
    from purrsight.training.run import train
    from tests.helpers import tiny_config

    class Installed(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            installed.append(getattr(pl_module, "_adapter_copies", None) is not None)
            passes.append(trainer.num_training_batches)

    installed: list[bool] = []
    passes: list[int | float] = []
    settings = {
        "trainer__precision": "bf16-mixed",
        "model__llm__gradient_checkpointing": "true",
        "model__llm__lora__dropout": 0.05,
        "trainer__accumulate_grad_batches": 3,
        "trainer__max_steps": 7,
        "trainer__val_every_n_steps": 3,
        "checkpoint__every_n_steps": 100,
        "telemetry__enabled": "false",
    }
    with_copies = tiny_config(synthetic_dir, tmp_path / "with", **settings)
    train(with_copies, None, callbacks=[Installed()])
    monkeypatch.setattr(trainer_module, "use_adapter_compute_copies", lambda model, precision: None)
    without = tiny_config(synthetic_dir, tmp_path / "without", **settings)
    train(without, None, callbacks=[Installed()])
    assert installed == [True, False] and passes == [16, 16]
    weights = [
        torch.load(config.run.run_dir / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
        for config in (with_copies, without)
    ]
    assert weights[0].keys() == weights[1].keys() and any(".lora_A." in name for name in weights[0])
    for name, value in weights[0].items():
        assert torch.equal(value, weights[1][name]), name


@pytest.mark.parametrize(("compiled", "installed"), [(False, True), (True, False)])
def test_the_trainer_installs_them_when_eager_and_leaves_them_to_the_compiled_graphs(
    synthetic_dir: Path, tmp_path: Path, compiled: bool, installed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    from purrsight.model.lora_compute_copies import installed_compute_copies
    from purrsight.training.module import Phase2Module
    from tests.helpers import tiny_config

    module = Phase2Module(tiny_config(synthetic_dir, tmp_path, trainer__compile=str(compiled).lower()))
    module.trainer = pl.Trainer(precision="bf16-mixed", accelerator="cpu", logger=False, enable_progress_bar=False)
    with caplog.at_level("INFO", logger="purrsight.training.module"):
        module.configure_model()  # compiles lazily: nothing is compiled until a call
    assert module.model is not None
    assert (installed_compute_copies(module.model) is not None) is installed
    said = "LoRA: 28 adapter matrices cast to bf16 once a decoder layer a micro-batch (2 layers), not at each use"
    assert (said in caplog.messages) is installed, caplog.messages  # the tiny default: 2 layers x 7 projections x A and B


def test_a_forward_without_gradients_inside_the_window_does_not_leave_the_training_one_without() -> None:
    """A no_grad forward (a reference or accuracy pass) first in a window makes copies without a
    graph; the training forward after it makes its own, and every adapter gets its gradient."""
    llm, copies, ids = with_copies(6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        copies.refresh("cpu")
        with torch.no_grad():
            llm(input_ids=ids, labels=ids)
        llm(input_ids=ids, labels=ids).loss.backward()
    copies.release()
    grads = [p.grad for n, p in llm.named_parameters() if ".lora_" in n]
    assert len(grads) == ADAPTERS and all(grad is not None and grad.abs().sum() > 0 for grad in grads)


def test_an_adapter_no_forward_used_gets_no_gradient_as_under_autocast() -> None:
    """A second peft adapter, trainable but inactive: None, not zeros (AdamW would decay zeros and
    DDP would not see the parameter unused)."""
    from peft import LoraConfig

    llm = small_lora_llm()
    second = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], bias="none", task_type="CAUSAL_LM")
    llm.add_adapter("second", second)
    for name, param in llm.named_parameters():
        param.requires_grad_(".lora_" in name)
    copies = use_adapter_compute_copies(llm, "bf16-mixed")
    assert copies is not None and sum(len(group) for group in copies.groups) == ADAPTERS + 2 * 2
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    accumulate(llm, copies, [ids])
    grads = {name: param.grad for name, param in llm.named_parameters() if ".lora_" in name}
    assert all(grads[name] is None for name in grads if ".second." in name)
    assert sum(grad is not None for grad in grads.values()) == ADAPTERS


def test_weights_that_change_end_the_copies_even_when_the_window_was_left_open() -> None:
    """An exception between ``refresh`` and ``release`` leaves copies behind; the optimizer step the
    trainer hooks and any state-dict load end them before a later forward could read them."""
    llm = small_lora_llm()
    copies = use_adapter_compute_copies(llm, "bf16-mixed")
    assert copies is not None
    optimizer = torch.optim.SGD([p for p in llm.parameters() if p.requires_grad], lr=1.0)
    optimizer.register_step_post_hook(copies.release)  # as training/module.py's configure_optimizers
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    for change in ("step", "load"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            copies.refresh("cpu")
            llm(input_ids=ids, labels=ids).loss.backward()  # and no release: as if the step raised
        assert copies.current is not None and copies.current[0] is not None
        if change == "step":
            optimizer.step()
        else:
            llm.load_state_dict(llm.state_dict())
        assert copies.current is None, change


def test_a_deep_copy_makes_its_own_copies_with_its_own_weights() -> None:
    """The pre-hooks are objects, so a deep copy's hooks fill the copy's table, never the
    original's; a copy taken with a window open starts with it shut."""
    import copy

    llm, copies, ids = with_copies(6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        copies.refresh("cpu")
        llm(input_ids=ids, labels=ids)
        twin = copy.deepcopy(llm)  # with the original's window open
        twin_copies = next(m.compute_copies for m in twin.modules() if isinstance(m, AdapterLinear))
        assert twin_copies is not copies and twin_copies.current is None
        twin_copies.refresh("cpu")
        twin(input_ids=ids, labels=ids)
    assert twin_copies.current is not None and all(made is not None for made in twin_copies.current)
    assert copies.current is not None and not any(
        made is twin_made for made, twin_made in zip(copies.current, twin_copies.current, strict=True)
    )
