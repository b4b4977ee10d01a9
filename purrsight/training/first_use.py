"""What a trainer builds at its first use, built at import, in a server that forks trainers.

The launcher's fork server (purrsight/launcher/forked_workers.py) imports the trainer's modules
once per node, and every worker is a fork of it. Two costs stayed each worker's, paid before its
first step (bench/launch/first_use.py; about 0.3 and 0.06 CPU-s on this project's machine):

- pandas, which pyarrow imports at its first array (the raw index's table, data/index.py);
- transformers' table of checkpoint conversions (its regular expressions compiled), built when
  peft injects the first adapter (it asks for the model's conversions, ``inject_adapter``).

Importing this module builds both, once, and each fork shares them. Neither runs a torch op (an
OpenMP pool does not survive a fork). pyarrow's allocator starts a thread of its own; jemalloc's
fork handlers hand a fork its allocator whole, as in the loader workers a trainer forks after
reading its index. Whatever building the table raises is dropped: multiprocessing's fork server
survives only an ImportError in its preload, and a transformers that moves or changes the table
must only lose the head start (the worker builds it as before; tests/unit/test_forked_workers.py
says it was lost).
"""

from __future__ import annotations

import contextlib

import pandas  # noqa: F401  (imported for its side effect: pyarrow finds it loaded)

with contextlib.suppress(Exception):  # any error: see above
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    get_checkpoint_conversion_mapping("qwen2")  # builds and keeps the whole table, every model type's
