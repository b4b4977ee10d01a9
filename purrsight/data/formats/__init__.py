"""The input formats a data set arrives in, read by one streaming interface (records.py: Record).

One module per format: our JSONL (data/index.py validates it; plain.py streams it), LLaVA
``conversations`` and ``messages`` JSON/JSONL (conversations.py), WebDataset tar shards
(tar_shards.py) and Parquet shards (parquet_shards.py); sources.py expands a path or glob into
files and tells their format. Every reader yields records one at a time from a resume point (a
byte offset, or a row), so memory stays flat in the number of samples; streams.py opens any of
them. Imports nothing heavy: the launcher's health check reads an index through it.
"""
