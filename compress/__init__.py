"""kvslim.compress: weight quantization into the compressed-tensors format, and the CLI front door."""
