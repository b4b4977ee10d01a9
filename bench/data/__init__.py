"""The data path: loader samples/s per worker, raw against prepared sets, prepare's memory, input formats at scale."""
