"""Every place PurrSight touches another project's private internals, one module per dependency.

Each module imports its dependency lazily, says what it touches and which version it was
written against, and is checked: at start where a moved internal would give wrong results
(Lightning's loop state), guarded where it must never stop training (a log filter).
tests/unit/test_internals.py fails on the installed versions when an internal moves;
docs/INTERNALS.md lists them. Imports nothing of PurrSight but ``errors``.
"""
