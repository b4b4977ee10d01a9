"""Keeping the ranks together, inside the training workers: process-group start-up, the
preflight checks, the stop vote, the watchdog with its hang culprit and flight recorder.

Imports the base modules only (config, errors, bad_nodes, run_folder); never ``training``,
``runs`` or the engines, which build on it.
"""
