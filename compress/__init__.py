"""kvslim.compress: weight quantization into the compressed-tensors format (RTN, GPTQ, SmoothQuant, scale tuning, FP8 KV-cache scales)."""
