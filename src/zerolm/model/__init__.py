"""The decoder and every setting of it: the GPT module (`decoder`: learned, ALiBi or rotary positions (`rotary`),
LayerNorm or RMSNorm, GELU or SwiGLU, grouped-query attention, tied or untied output), its block (`block`) and
projections (`projections`), attention by implementation (`attention`), dropout, the losses, generation with a
KV cache, and the FLOPs per token that MFU counts. What `auto` means for it on a device is zerolm.parallel.auto's
to say; the model takes only resolved configs.

May import: core, config.
"""
