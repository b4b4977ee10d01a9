"""The LM head and its cross-entropy, a chunk of rows at a time: the logits never exist whole.

transformers' causal LM computes ``lm_head`` at every position, upcasts the (batch, length,
vocabulary) logits to fp32 and keeps their log-softmax for backward: at the 7B preset (152,064
entries a row) about 16 GB a GPU, most of it at prefix and prompt positions that carry no label.
Here the head runs only on the rows whose next token is labelled, ``rows`` of them at a time:
each chunk's logits are made, scored and turned into the gradient of the hidden states (and of
the head's weight, when it trains) within the forward, then freed. Backward scales what forward
kept by the loss's gradient. The peak is one chunk's logits, whatever the length or vocabulary.

Numerics as transformers': the matmul in the compute dtype (autocast's, under mixed
precision), the log-softmax and the loss in fp32, the mean over labelled positions.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.nn.functional import linear

from purrsight.labels import IGNORE_INDEX

CHUNK_BYTES = 256 * 2**20  # one chunk's fp32 logits; its transient peak is about three of them
LOSS_METHOD = "linear_cross_entropy"  # attached to the head; fsdp.py registers it as a forward of its unit


def chunk_rows(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows a chunk holds: 441 at a vocabulary of 152,064."""
    return max(1, chunk_bytes // (4 * vocab_size))


class _LinearCrossEntropy(torch.autograd.Function):
    """(summed loss, predictions or None) of ``hidden @ weight.T`` against ``targets``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int, predict: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        predicted = torch.empty(targets.shape if predict else (0,), dtype=torch.long, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for start in range(0, hidden.shape[0], rows):
            chunk, wanted = hidden[start : start + rows], targets[start : start + rows]
            logits = linear(chunk, weight)  # in autocast's dtype under mixed precision, as lm_head's
            compute_dtype, upcast = logits.dtype, logits.float()
            del logits
            labelled = wanted != IGNORE_INDEX
            target = wanted.clamp(min=0)[:, None]
            normaliser = torch.logsumexp(upcast, dim=-1, keepdim=True)
            total += ((normaliser - upcast.gather(1, target)).squeeze(1) * labelled).sum()
            if predict:
                predicted[start : start + rows] = upcast.argmax(dim=-1)
            if grad_hidden is None and grad_weight is None:
                continue
            # d(loss)/d(logits) = softmax - one-hot, at labelled rows only; made in place of the upcast.
            grad_logits = upcast.sub_(normaliser).exp_()
            grad_logits.scatter_add_(1, target, torch.full_like(normaliser, -1.0))
            grad_logits.mul_(labelled[:, None])
            grad_logits = grad_logits.to(compute_dtype)  # autograd's too: the upcast's backward casts back
            if grad_hidden is not None:
                grad_hidden[start : start + rows] = grad_logits @ weight.to(compute_dtype)
            if grad_weight is not None:
                grad_weight += (grad_logits.T @ chunk.to(compute_dtype)).float()
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(predicted)
        return total, predicted

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_out = None if grad_hidden is None else grad_hidden * grad_total.to(grad_hidden.dtype)
        weight_out = None if grad_weight is None else (grad_weight * grad_total).to(ctx.weight_dtype)
        return hidden_out, weight_out, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int, predict: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss over labelled rows, argmax per row, empty unless ``predict``).

    hidden (N, H), weight (V, H), targets (N,) with IGNORE_INDEX where a row has no label;
    ``rows``: rows a chunk. Gradients flow to ``hidden`` and ``weight`` where they require them.
    """
    total, predicted = _LinearCrossEntropy.apply(hidden, weight, targets, rows, predict)
    return total, predicted


def attach_loss(head: nn.Module, rows: int) -> None:
    """Gives ``head`` (an ``nn.Linear``) the method ``linear_cross_entropy(hidden, targets, predict)``.

    A method of the head's own, so that when the head is an FSDP unit of its own (an untied head,
    training/fsdp.py) FSDP can gather its weight around the call as it does around its forward.
    """

    def loss(hidden: torch.Tensor, targets: torch.Tensor, predict: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return linear_cross_entropy(hidden, cast(torch.Tensor, head.weight), targets, rows, predict)

    setattr(head, LOSS_METHOD, loss)
