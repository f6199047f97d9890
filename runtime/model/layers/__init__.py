"""Decoder building blocks: linear (dense and quantized), attention, rotary, norm, MLP."""
