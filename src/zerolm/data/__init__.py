"""Text sources, tokenizers, packing into fixed-length samples, and the distributed batch loader."""
