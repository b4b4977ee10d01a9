"""The second engine: the same training on a Ray cluster (``train_phase2.py --engine ray``).

``driver`` runs where ``ray job submit`` starts the entry point: it checks the config, the
data and the run folder, then hands the workers to Ray Train's TorchTrainer. ``worker`` is
the function each Ray Train worker runs: it maps Ray's ranks and checkpoints onto
``purrsight.training.run.train``. ``coordinator`` carries what Ray has no channel for
(a stop signal, a user error, worker starts) between them. Never named ``ray``: a module of
that name would shadow the package.
"""
