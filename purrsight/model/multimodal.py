"""The assembled Phase 2 model: [image prefix][audio prefix][prompt][response] -> LLM.

Where a sample's text had a media placeholder (``<image>``, ``<audio>``: data/text.py), that
modality's projected tokens go there instead of in front: the collator hands the token index as
``media_at`` and ``place_media`` moves every position to its place with one scatter, whose
indices are computed on the device from that small tensor (no host synchronisation).

Missing modalities. A batch always carries a tensor per enabled modality plus a
``has_<modality>`` mask; a sample without an image gets a blank image. Its projected
prefix is multiplied by 0 and masked out of attention and the loss, so it cannot affect
the sample, yet every projector parameter stays in the autograd graph every step. That
matters under DDP: a projector left out of one rank's graph would hang or fail the
gradient all-reduce ("parameters that were not used in producing loss"), and
``find_unused_parameters=True`` would cost a graph walk per step.

No host synchronisation. On a GPU the host queues kernels ahead of the device unless it reads a
device value or runs an op whose output size depends on the data. So the samples that hold a
modality arrive as a row index sized by the collator on the CPU (``<modality>_rows``), not as
a mask to select with, and the attention mask is built here in the form the attention kernel
takes, so transformers need not read it to decide whether it can be skipped.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import torch
from peft import PeftModel
from torch import nn
from transformers import PreTrainedModel

from purrsight.labels import IGNORE_INDEX
from purrsight.model.aligner import Phase1Aligner
from purrsight.model.encoders import FrozenEncoder
from purrsight.model.linear_cross_entropy import LOSS_METHOD, attach_loss, chunk_rows
from purrsight.model.projector import Projector, ProjectorKind, TokenProjector, build_projector

MODALITIES = ("image", "audio")


class Scored(NamedTuple):
    """What a forward gives: the mean cross-entropy over the labelled positions (transformers'
    causal LM loss) and, when asked, per sample whether every labelled token is the argmax."""

    loss: torch.Tensor
    correct: torch.Tensor | None = None


class PurrSightModel(nn.Module):
    def __init__(
        self,
        llm: PeftModel,
        encoders: dict[str, FrozenEncoder],
        aligner: Phase1Aligner | None,
        prefix_tokens: int,
        projector_hidden: int,
        pixel_scaling: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention: str = "sdpa",
        projector: ProjectorKind = "tokens",
    ) -> None:
        """``pixel_scaling``: per-channel (scale, offset) that turn uint8 pictures into the image
        tower's input (the image processor's rescale and normalisation). ``attention``: the LLM's
        attention implementation (the form of mask it takes). ``projector``: model/projector.py."""
        super().__init__()
        self.attention = attention
        scale, offset = pixel_scaling if pixel_scaling is not None else (torch.ones(3, 1, 1), torch.zeros(3, 1, 1))
        # Not persistent: fixed by the processor, so no part of a checkpoint or of the weights' fingerprint.
        self.register_buffer("pixel_scale", scale.clone(), persistent=False)
        self.register_buffer("pixel_offset", offset.clone(), persistent=False)
        self.pixel_scale: torch.Tensor
        self.pixel_offset: torch.Tensor
        self.llm = llm
        head = llm.get_output_embeddings()
        attach_loss(head, chunk_rows(head.weight.shape[0]))
        self.encode_every_step = False  # set when the towers are sharded (training/fsdp.py)
        self.encoders = nn.ModuleDict(encoders)
        self.aligner = aligner
        hidden = llm.get_input_embeddings().embedding_dim
        self.projector_kind = projector
        self.projectors = nn.ModuleDict(
            {
                name: build_projector(
                    projector,
                    aligner.dim if aligner else enc.width,
                    projector_hidden,
                    hidden,
                    prefix_tokens,
                    "grid" if name == "image" else "sequence",
                )
                for name, enc in encoders.items()
            }
        )

    # The LM's body and head, called apart: the head runs only where a label is, in chunks
    # (model/linear_cross_entropy.py), never at every position as the causal LM's forward does.
    # Looked up, not kept: a second name for a submodule would put its weights twice in state_dict.
    @property
    def decoder(self) -> nn.Module:
        base = cast(PreTrainedModel, self.llm.get_base_model())
        return cast(nn.Module, base.get_decoder())

    @property
    def head(self) -> nn.Module:
        return cast(nn.Module, self.llm.get_output_embeddings())

    def _prefix(self, modality: str, inputs: torch.Tensor, present: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The projected prefix of every sample; zeros where ``present`` is False.

        ``rows``: the indices of the samples that hold this modality. Only they are encoded,
        selected by index: its size is known on the host, so no step waits for the device.
        """
        encoder = cast(FrozenEncoder, self.encoders[modality])
        projector = cast(TokenProjector | Projector, self.projectors[modality])
        features = torch.zeros(inputs.shape[0], projector.reduced_tokens, encoder.width, device=inputs.device)
        if rows.numel():  # shape metadata, not a device value
            # Reduced before the aligner: both are linear per token (an average, an affine map),
            # so the order does not change the result, and the aligner then reads a few tokens.
            encoded = projector.reduce(encoder(inputs.index_select(0, rows))).to(features.dtype)
            features = features.index_copy(0, rows, encoded)
        elif self.encode_every_step:
            encoder(inputs[:1])  # a sharded tower's all-gather must run on every rank; the result is not used
        if self.aligner is not None:
            features = self.aligner(modality, features)
        prefix = projector(features)
        return prefix * present.to(prefix.dtype)[:, None, None]

    def tower_input(self, batch: dict[str, Any], modality: str) -> torch.Tensor:
        """The batch's tensor for a tower. uint8 pixels are normalised here, on the device: the
        loader, its workers' hand-over and the copy to the GPU move a quarter of the bytes."""
        inputs = cast(torch.Tensor, batch[modality])
        if inputs.dtype != torch.uint8:
            return inputs
        return inputs.float().mul_(self.pixel_scale).add_(self.pixel_offset)

    def build_inputs(self, batch: dict[str, Any]) -> dict[str, torch.Tensor | None]:
        """inputs_embeds, attention_mask and labels: the modality prefixes in front, or where the
        batch's ``media_at`` places them."""
        text = self.llm.get_input_embeddings()(batch["input_ids"])
        embeds, masks, labels = [], [], []
        for modality in self.encoders:
            present = batch[f"has_{modality}"]
            prefix = self._prefix(modality, self.tower_input(batch, modality), present, batch[f"{modality}_rows"])
            embeds.append(prefix.to(text.dtype))
            masks.append(present.long()[:, None].expand(-1, prefix.shape[1]))
            labels.append(torch.full(prefix.shape[:2], IGNORE_INDEX, device=text.device, dtype=torch.long))
        embeds_all = torch.cat([*embeds, text], dim=1)
        keys = torch.cat([*masks, batch["attention_mask"]], dim=1)
        labels_all = torch.cat([*labels, batch["labels"]], dim=1)
        media_at = batch.get("media_at")
        if media_at is not None:
            to = media_destinations([prefix.shape[1] for prefix in embeds], text.shape[1], media_at)
            embeds_all, keys, labels_all = (place_media(part, to) for part in (embeds_all, keys, labels_all))
        return {
            "inputs_embeds": embeds_all,
            "attention_mask": self.attention_mask(keys, bool(batch.get("padded", True))),
            "labels": labels_all,
        }

    def attention_mask(self, keys: torch.Tensor, padded: bool) -> torch.Tensor | None:
        """The mask the LLM is given, from the (batch, length) mask of real positions.

        ``padded`` (known to the collator, on the host) False: no mask at all, so SDPA runs
        causal and may take its flash kernel. With padding under SDPA: the 4-D boolean mask
        (causal and real keys) that transformers would build, built here because transformers
        first reads the 2-D mask on the host to see whether it could skip it. Eager attention
        builds its mask without reading it: it gets the 2-D one.
        """
        if not padded:
            return None
        if self.attention != "sdpa":
            return keys
        length = keys.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=keys.device).tril()
        return causal[None, None] & keys.bool()[:, None, None, :]

    def forward(self, batch: dict[str, Any], accuracy: bool = False) -> Scored:
        """The loss of ``batch`` and, with ``accuracy``, which samples the model gets wholly right
        (teacher forced)."""
        inputs = self.build_inputs(batch)
        labels = cast(torch.Tensor, inputs.pop("labels"))
        hidden = self.decoder(**inputs, use_cache=False).last_hidden_state
        rows, targets = labelled_rows(labels, batch.get("num_labelled"))
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
        total, predicted = getattr(self.head, LOSS_METHOD)(picked, targets, accuracy)
        labelled = targets != IGNORE_INDEX
        loss = total / labelled.sum()  # transformers' mean: NaN where nothing is labelled, as theirs
        if not accuracy:
            return Scored(loss)
        wrong = ((predicted != targets) & labelled).long()
        wrong_per_sample = torch.zeros(labels.shape[0], dtype=torch.long, device=labels.device)
        return Scored(loss, wrong_per_sample.index_add(0, rows // labels.shape[1], wrong) == 0)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


def labelled_rows(labels: torch.Tensor, at_most: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat positions of ``labels`` (batch, length) whose next token is labelled, and that token.

    Position p predicts token p + 1, as transformers shifts. ``at_most`` (the collator's count of
    labelled tokens, known on the host) sizes the selection, so no step waits for the device to
    count; padding rows point at the last position, whose target is IGNORE_INDEX. Without it,
    every position is a row (the estimate's worst case).
    """
    batch, length = labels.shape
    following = torch.cat([labels[:, 1:], labels.new_full((batch, 1), IGNORE_INDEX)], dim=1).reshape(-1)
    size = batch * length if at_most is None else min(at_most, batch * length)
    rows = torch.nonzero_static(following != IGNORE_INDEX, size=size, fill_value=batch * length - 1).squeeze(1)
    return rows, following.index_select(0, rows)


def media_destinations(prefix_lengths: list[int], text_length: int, media_at: torch.Tensor) -> torch.Tensor:
    """(batch, length): where each position of ``[prefix 0][prefix 1]...[text]`` goes in the sequence.

    ``media_at`` (batch, modalities): the text token each modality's prefix goes before; 0 puts it
    in front, where modalities at one index keep their order. A text token moves right by every
    prefix placed at or before it; a prefix starts at its index plus the prefixes placed before it.
    """
    device = media_at.device
    token = torch.arange(text_length, device=device)
    text_to = token[None, :].expand(media_at.shape[0], -1).clone()
    prefix_to = []
    for m, length in enumerate(prefix_lengths):
        text_to += (media_at[:, m, None] <= token[None, :]).long() * length
        start = media_at[:, m].clone()
        for other, other_length in enumerate(prefix_lengths):
            if other != m:
                ahead = media_at[:, other] < media_at[:, m]
                if other < m:
                    ahead = ahead | (media_at[:, other] == media_at[:, m])
                start += ahead.long() * other_length
        prefix_to.append(start[:, None] + torch.arange(length, device=device)[None, :])
    return torch.cat([*prefix_to, text_to], dim=1)


def place_media(part: torch.Tensor, to: torch.Tensor) -> torch.Tensor:
    """``part`` (batch, length, ...) with position i moved to ``to[:, i]`` (a permutation per row)."""
    index = to.view(*to.shape, *([1] * (part.dim() - 2))).expand_as(part)
    return torch.zeros_like(part).scatter(1, index, part)
