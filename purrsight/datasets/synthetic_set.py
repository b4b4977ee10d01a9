"""The synthetic set a config names, generated once before training reads it.

Its own module, light to import: the Ray engine's driver calls it before any worker starts,
and should not import the model stack to check that a folder exists.
"""

from __future__ import annotations

from purrsight.config import Config
from purrsight.data.synthetic import generate


def ensure_synthetic_set(config: Config) -> None:
    """Generate the synthetic set the config names, once (a no-op when it exists); none: nothing."""
    data = config.data
    if data.synthetic_dir is not None:
        s = data.synthetic
        generate(data.synthetic_dir, s.num_train, s.num_val, s.seed, s.image_size)
