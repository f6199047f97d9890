"""The activation dtypes a user may ask for, torch-free (the CLI's parsers read them without torch)."""
from __future__ import annotations

AUTO = "auto"
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = (AUTO, *DTYPE_NAMES)
DTYPE_HELP = "activations; auto (default): bfloat16 on a CPU with native bf16 or on CUDA, else float32"
