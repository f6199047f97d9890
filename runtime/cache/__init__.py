"""The paged KV cache: layout, store and gather, quantization, bytes per token."""
