"""Text to batches: raw sources, tokenizers, packing into fixed-length samples and shards (`zerolm prepare`),
the prepared dataset's manifest and reader, the order a run reads a split in, mixtures, and the
distributed, resumable batch loader.

May import: core, config, model, parallel.
"""
