"""What every model loader shares: its error type and the digest that names an architecture."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from purrsight.errors import UserError


class ModelLoadError(UserError):
    """A model source that cannot be used; the message names the path or key."""


def architecture_digest(config: dict[str, Any]) -> str:
    """A digest of an architecture; where its folder lies is no part of it.

    Hugging Face configs carry the folder they were read from (``_name_or_path``): a model
    moved, or mounted elsewhere on another node, is the same model. Its weights are
    fingerprinted by content (training/model_builder.py).
    """
    architecture = {key: value for key, value in config.items() if key != "_name_or_path"}
    return hashlib.sha256(json.dumps(architecture, sort_keys=True, default=str).encode()).hexdigest()[:16]
