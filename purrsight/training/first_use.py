"""What a trainer builds at its first use, built at import, in a server that forks trainers.

The launcher's fork server (purrsight/launcher/forked_workers.py) imports the trainer's modules
once per node, and every worker is a fork of it. Two costs stayed each worker's, paid before its
first step (a forked worker of the tiny default, 2026-11-29: 1.2-1.4 CPU-s to its end, 0.9-1.0
with this module in the server):

- pandas, which pyarrow imports at its first array (the raw index's table, data/index.py);
- transformers' table of checkpoint conversions, some 1,000 regular expressions compiled when
  peft injects the first adapter (it asks for the model's conversions, ``inject_adapter``).

Importing this module builds both, once, and each fork shares them. Neither runs a torch op (an
OpenMP pool does not survive a fork). pyarrow's allocator starts a thread of its own; jemalloc's
fork handlers hand a fork its allocator whole, as in the loader workers a trainer forks after
reading its index. A transformers that moves the table only loses the head start: the worker
builds it as before.
"""

from __future__ import annotations

import contextlib

import pandas  # noqa: F401  (imported for its side effect: pyarrow finds it loaded)

with contextlib.suppress(ImportError, AttributeError):
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    get_checkpoint_conversion_mapping("qwen2")  # builds and keeps the whole table, every model type's
