"""The GPU step: tokens/s, MFU and peak memory on one GPU, torch.compile, and host synchronisations per step."""
