"""What a run shows of itself: the progress bar, telemetry (throughput, MFU, memory), the
profiler, the loggers and experiment trackers with their delivery ledger, and the report.

Imports the base modules, ``model`` (FLOPs are counted from the model's shapes) and ``runs``
(the report reads the attempt records); never ``training`` or the engines. docs/OBSERVABILITY.md
is its user's page.
"""
