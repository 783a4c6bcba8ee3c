"""zerolm: GPT-style language model pretraining in JAX with ZeRO-1 optimizer-state sharding."""

__version__ = "0.1.0"
