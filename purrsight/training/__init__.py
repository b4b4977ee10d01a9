"""The Lightning wiring of a training run: the LightningModule, the DataModule, the optimizer,
the builders of model and trainer, the run itself (``run.train``) and the export of its result.

The top floor under the engines: it may import every package but ``launcher`` and
``ray_engine``.
"""
