"""A run's life across its attempts: how an attempt starts (fresh, resumed, refused), the
checkpoints it writes and finds, the data position they carry, and the attempt records.

Imports the base modules (config, errors, atomic_file, run_folder) and ``distributed`` (the
start decision and the stop vote are agreed by every rank); never ``training``,
``observability`` or the engines above them.
"""
