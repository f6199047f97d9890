"""kvslim.runtime: serving compressed checkpoints (decoder, paged KV cache, engine, server)."""
