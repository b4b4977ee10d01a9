"""Wiring: LightningModule, DataModule, callbacks, checkpoints, trainer factory, export."""
