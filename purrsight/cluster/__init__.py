"""Nodes, processes and schedulers (nothing about models): launch environment, health, logs."""
