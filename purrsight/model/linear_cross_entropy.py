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

import types
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.nn.functional import linear

from purrsight.labels import IGNORE_INDEX

CHUNK_BYTES = 256 * 2**20  # one chunk's fp32 logits; its transient peak is about three of them
LOSS_METHOD = "linear_cross_entropy"  # attached to the head; fsdp.py registers it as a forward of its unit
SCORER = "chunk_scorer"  # the head's attribute that holds the function scoring a chunk


def chunk_rows(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows a chunk holds: 441 at a vocabulary of 152,064."""
    return max(1, chunk_bytes // (4 * vocab_size))


ChunkScores = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def score_chunk(
    chunk: torch.Tensor, weight: torch.Tensor, wanted: torch.Tensor, want_hidden: bool, want_weight: bool, predict: bool
) -> ChunkScores:
    """One chunk of rows: (summed loss, argmax per row or None, gradient of the chunk's hidden
    states or None, its part of the head's weight gradient in fp32 or None). A function of its
    own so that ``trainer.compile`` can compile it (compiled_scorer): eager, it is some fifteen
    kernels a chunk, most of them passes over the chunk's fp32 logits."""
    logits = linear(chunk, weight)  # in autocast's dtype under mixed precision, as lm_head's
    compute_dtype, upcast = logits.dtype, logits.float()
    del logits
    labelled = wanted != IGNORE_INDEX
    target = wanted.clamp(min=0)[:, None]
    normaliser = torch.logsumexp(upcast, dim=-1, keepdim=True)
    loss = ((normaliser - upcast.gather(1, target)).squeeze(1) * labelled).sum()
    predicted = upcast.argmax(dim=-1) if predict else None
    if not (want_hidden or want_weight):
        return loss, predicted, None, None
    # d(loss)/d(logits) = softmax - one-hot, at labelled rows only; made in place of the upcast.
    grad_logits = upcast.sub_(normaliser).exp_()
    grad_logits.scatter_add_(1, target, torch.full_like(normaliser, -1.0))
    grad_logits.mul_(labelled[:, None])
    grad_logits = grad_logits.to(compute_dtype)  # autograd's too: the upcast's backward casts back
    grad_chunk = grad_logits @ weight.to(compute_dtype) if want_hidden else None
    grad_weight = (grad_logits.T @ chunk.to(compute_dtype)).float() if want_weight else None
    return loss, predicted, grad_chunk, grad_weight


Scorer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, bool, bool], ChunkScores]


SCORER_RECOMPILE_LIMIT = 32  # a run needs 8 (below); dynamo's shared default is 8, past which it runs eagerly


def compiled_scorer() -> Scorer:
    """``score_chunk`` compiled: one or two fused kernels over a chunk's logits besides its matmuls.

    Compilations a run needs: dynamo guards on the flags (training's gradients against
    validation's predictions, under inference mode), a row count of 1 against more, a chunk at
    the batch's start (storage offset 0) against a later one, and the first row count against
    the symbolic one its first recompilation brings: 8 in a training and validation pattern
    (measured on the CPU, then none in 30 more row counts). So the scorer has a recompile limit
    of its own, apart from the decoder layers' (``isolate_recompiles``: each call's entries count
    against its own limit), with room to spare.
    """
    # torch 2.13's stubs lack these two arguments of torch.compile (its signature has them).
    compiled = torch.compile(score_chunk, recompile_limit=SCORER_RECOMPILE_LIMIT, isolate_recompiles=True)  # type: ignore[call-overload]
    return cast(Scorer, compiled)


class _LinearCrossEntropy(torch.autograd.Function):
    """(summed loss, predictions or None) of ``hidden @ weight.T`` against ``targets``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: int, predict: bool, score: Scorer
    ) -> tuple[torch.Tensor, torch.Tensor]:
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        predicted = torch.empty(targets.shape if predict else (0,), dtype=torch.long, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        for start in range(0, hidden.shape[0], rows):
            chunk, wanted = hidden[start : start + rows], targets[start : start + rows]
            loss, chunk_predicted, grad_chunk, grad_weight_part = score(chunk, weight, wanted, want_hidden, want_weight, predict)
            total += loss
            if chunk_predicted is not None:
                predicted[start : start + rows] = chunk_predicted
            if grad_hidden is not None and grad_chunk is not None:
                grad_hidden[start : start + rows] = grad_chunk
            if grad_weight is not None and grad_weight_part is not None:
                grad_weight += grad_weight_part
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(predicted)
        return total, predicted

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_out = None if grad_hidden is None else grad_hidden * grad_total.to(grad_hidden.dtype)
        weight_out = None if grad_weight is None else (grad_weight * grad_total).to(ctx.weight_dtype)
        return hidden_out, weight_out, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    rows: int,
    predict: bool = False,
    score: Scorer = score_chunk,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss over labelled rows, argmax per row, empty unless ``predict``).

    hidden (N, H), weight (V, H), targets (N,) with IGNORE_INDEX where a row has no label;
    ``rows``: rows a chunk; ``score``: what scores a chunk (score_chunk, or compiled_scorer's).
    Gradients flow to ``hidden`` and ``weight`` where they require them.
    """
    total, predicted = _LinearCrossEntropy.apply(hidden, weight, targets, rows, predict, score)
    return total, predicted


def attach_loss(head: nn.Module, rows: int) -> None:
    """Gives ``head`` (an ``nn.Linear``) the method ``linear_cross_entropy(hidden, targets, predict)``.

    A method of the head's own, so that when the head is an FSDP unit of its own (an untied head,
    training/fsdp.py) FSDP can gather its weight around the call as it does around its forward.
    Bound to the head, not closed over it: a copy of the model (``copy.deepcopy``) scores with its
    own head. The chunk scorer is looked up at each call: ``use_scorer`` swaps it
    (``trainer.compile``) without replacing the method FSDP wrapped.
    """
    use_scorer(head, score_chunk)

    def loss(
        self: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, predict: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        score = cast(Scorer, getattr(self, SCORER))
        return linear_cross_entropy(hidden, cast(torch.Tensor, self.weight), targets, rows, predict, score)

    setattr(head, LOSS_METHOD, types.MethodType(loss, head))


def use_scorer(head: nn.Module, score: Scorer) -> None:
    """What scores each chunk of ``head``'s loss from now on (score_chunk, or compiled_scorer's)."""
    setattr(head, SCORER, score)  # a plain attribute: neither a submodule nor part of state_dict
