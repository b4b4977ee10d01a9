"""Files and samples: the JSONL index, media decoding, tokenisation, collation, the sampler,
the prepared-shard format and manifest, the synthetic generator.

Knows no config and no model (it takes plain arguments), so the launcher may read an index
or a manifest without torch.
"""
