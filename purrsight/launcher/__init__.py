"""The launcher's steps: what cluster_train.sh runs on a node before and around torchrun.

These modules must not import torch at module level (tests/unit/test_package_layering.py):
the launcher's start-up pays for every import, and a node without a working torch must
still get a clear error from ``prepare``. ``torchrun`` is the exception: it is torch's agent.
"""
