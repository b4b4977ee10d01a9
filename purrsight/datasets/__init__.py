"""Datasets as the config names them: built for training (from JSONL indexes or a prepared
set), written ahead by the dataset job (``train_phase2.py prepare``) and generated (the
synthetic set of the embedded default).

Above ``data`` (samples, decoding, the prepared-shard format), ``model`` (the towers'
processors and the tokenizer decide how a sample is encoded) and ``distributed`` (one rank
checks a set for all); never imports ``training``, ``runs`` or ``observability``.
"""
