"""Files and samples: the JSONL index, media decoding, tokenisation, collation, the synthetic set."""
