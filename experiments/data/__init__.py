"""The data path: tokenising, the batch iterator, shard reads, the document sampler."""
