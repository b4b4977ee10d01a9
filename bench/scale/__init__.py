"""Scaling out: 1 to 16 nodes on one machine, weak scaling on CPU, and the 128-node x 8-GPU model."""
