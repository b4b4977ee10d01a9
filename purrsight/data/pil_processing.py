"""An image processor's own steps, called directly: the same tensor at a fraction of the cost.

Hugging Face's PIL image processors (SigLIP, CLIP, ViT and the like, when torchvision is not
installed: it is not with the CPU build of torch) run each picture through a generic
pipeline: Pillow ``resize`` with the processor's filter, a centre crop, rescale, normalise.
Around those few calls they convert PIL -> NumPy -> PIL -> NumPy, infer channel layouts and
validate arguments, about half of a sample's decoding time (bench/results/data.md). A plan made
from the processor's own settings replays the same Pillow calls on the decoded picture, so
the tower gets what it was trained on (tested equal to the processor's output to 1e-6).

A processor this does not reproduce exactly (its own ``_preprocess``, padding, other size
rules) gets no plan and is called as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

Normalisation = tuple[float, torch.Tensor, torch.Tensor]  # rescale factor, mean and std per channel (3, 1, 1)


def fused_normalisation(processor: Any | None) -> Normalisation | None:
    """(rescale factor, mean, std) of a processor that rescales, then normalises, as most do.

    Hugging Face's PIL backend does both steps in float64 NumPy: a quarter of the decoding
    time of a 224-px sample (bench/results/data.md). Done here in float32 on the processor's
    resized uint8 output, the result equals the processor's to within 1e-6.
    """
    if processor is None or not (getattr(processor, "do_rescale", False) and getattr(processor, "do_normalize", False)):
        return None
    factor, mean, std = (getattr(processor, name, None) for name in ("rescale_factor", "image_mean", "image_std"))
    if factor is None or mean is None or std is None:
        return None
    return float(factor), _per_channel(mean), _per_channel(std)


def _per_channel(value: float | list[float]) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32).reshape(-1, 1, 1)


def scale_and_offset(normalisation: Normalisation) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x * factor - mean) / std`` as ``x * scale + offset``, per channel (3, 1, 1)."""
    factor, mean, std = normalisation
    return factor / std, -mean / std


def scale_pixels(pixels: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``pixels * scale + offset`` in float32, for one channel-first picture or a batch of them, on their device.

    One multiply and one add in place: half the time of the three-pass ``(x * factor - mean) / std``
    on a 224-px picture, within 1e-6 of it.
    """
    return pixels.float().mul_(scale.to(pixels.device)).add_(offset.to(pixels.device))


def normalise(pixels: torch.Tensor, normalisation: Normalisation) -> torch.Tensor:
    """Rescale and normalise channel-first pixels as the processor does, in float32."""
    return scale_pixels(pixels, *scale_and_offset(normalisation))


@dataclass(frozen=True)
class PilPlan:
    height: int | None  # an exact output size, or...
    width: int | None
    shortest_edge: int | None  # ...the shorter side, the aspect ratio kept
    resample: int  # Pillow's filter number
    crop: tuple[int, int] | None  # (height, width) of the centre crop
    normalisation: Normalisation

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after the resize, by the processor's rule (transformers' integer truncation)."""
        if self.shortest_edge is None:
            assert self.width is not None and self.height is not None
            return self.width, self.height
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(self.shortest_edge * long / short)
        return (self.shortest_edge, new_long) if width <= height else (new_long, self.shortest_edge)

    def output_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of the tensor made from a ``width`` x ``height`` picture."""
        if self.crop is not None:
            return self.crop[1], self.crop[0]
        return self.resized_size(width, height)

    def pixels(self, image: Image.Image) -> torch.Tensor:
        """The resized and cropped picture, channel-first uint8: what a prepared set stores."""
        image = image.resize(self.resized_size(*image.size), resample=self.resample, reducing_gap=None)
        if self.crop is not None:
            crop_height, crop_width = self.crop
            top, left = (image.height - crop_height) // 2, (image.width - crop_width) // 2
            image = image.crop((left, top, left + crop_width, top + crop_height))
        return torch.from_numpy(np.array(image)).permute(2, 0, 1)  # a copy: PIL's buffer is read-only

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return normalise(self.pixels(image), self.normalisation)


def plan_for(processor: Any) -> PilPlan | None:
    """The plan that reproduces ``processor`` exactly, or None when there is none."""
    try:
        from transformers.image_processing_backends import PilBackend
    except ImportError:  # an older transformers: its processors are called as they are
        return None
    if not isinstance(processor, PilBackend) or type(processor)._preprocess is not PilBackend._preprocess:
        return None
    settings: Any = processor  # its fields are set from its class and its saved config, not declared
    normalisation = fused_normalisation(processor)
    if not settings.do_resize or normalisation is None or getattr(settings, "do_pad", False):
        return None
    size, crop_size = settings.size, getattr(settings, "crop_size", None)
    rules = {name for name in ("height", "width", "shortest_edge", "longest_edge", "max_height", "max_width") if size.get(name)}
    if rules not in ({"height", "width"}, {"shortest_edge"}):
        return None
    crop = None
    if settings.do_center_crop:
        if crop_size is None or not (crop_size.get("height") and crop_size.get("width")):
            return None
        crop = (int(crop_size["height"]), int(crop_size["width"]))
        smallest = (size["shortest_edge"],) * 2 if "shortest_edge" in rules else (size["height"], size["width"])
        if crop[0] > smallest[0] or crop[1] > smallest[1]:
            return None  # the processor pads a crop larger than the picture: not reproduced here
    return PilPlan(
        height=size.get("height"),
        width=size.get("width"),
        shortest_edge=size.get("shortest_edge"),
        resample=int(settings.resample if settings.resample is not None else Image.Resampling.BILINEAR),
        crop=crop,
        normalisation=normalisation,
    )
