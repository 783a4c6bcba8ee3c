"""The decoder and every setting of it: the GPT module (`decoder`: learned, ALiBi or rotary positions,
LayerNorm or RMSNorm, GELU or SwiGLU, grouped-query attention, tied or untied output), attention by
implementation, dropout, the losses, generation with a KV cache, the FLOPs per token that MFU counts, and
what `auto` means for the model on a device (`device_policy`).

May import: core, config.
"""
