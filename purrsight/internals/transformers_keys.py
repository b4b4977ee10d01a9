"""How transformers names a weight file's tensors in the model it loads them into (written against
transformers 5.24), which it offers only from modules it does not document.

``from_pretrained`` passes every key of a model's weight files through the model's own conversion
mapping (``conversion_mapping.get_model_conversion_mapping``): renamings, such as EXAONE's
``transformer.h.N.attn.attention.`` for ``model.layers.N.self_attn.``, and converters that merge or
split tensors (fused experts, fused projections); ``core_model_loading.rename_source_key`` applies
them and adds or strips the base model's prefix. A sharded build reads each tensor's rows straight
from the files (training/fsdp.py), so it must name them the same way.

Guarded: where these move, every key is taken as the model's own name. A model that renames then
stops at its first missing tensor with one line naming it (model/weight_files.py), never reading
a wrong tensor: a key the model does not rename is its own name in either case.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)


def loaded_names(model: Any, file_keys: Iterable[str], model_names: Iterable[str]) -> dict[str, tuple[str, bool]]:
    """Each key of ``file_keys`` -> (the name ``from_pretrained`` loads it as in ``model``, whether a
    converter makes that tensor from others: merged or split, so not readable by rows as it lies).

    ``model``: the Hugging Face model as built (its sub-models decide the mapping);
    ``model_names``: its parameter names, for the base-model prefix transformers adds or strips.
    """
    keys = list(file_keys)
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key

        transforms = get_model_conversion_mapping(model)
    except (ImportError, AttributeError, TypeError) as error:
        log.warning("transformers' weight-key conversion not found (%s): weight-file keys are read as the model's names", error)
        return {key: (key, False) for key in keys}
    renamings: list[Any] = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters: list[Any] = [t for t in transforms if isinstance(t, WeightConverter)]
    present = {name: name for name in model_names}  # transformers tests `.get(name) is not None`
    prefix = getattr(model, "base_model_prefix", None) or None
    names: dict[str, tuple[str, bool]] = {}
    for key in keys:
        name, converter = rename_source_key(key, renamings, converters, prefix, present)
        names[key] = (name, converter is not None)
    return names
