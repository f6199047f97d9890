"""`python -m compress.demo` (what `make demo` runs): the main job end to end on the default model.

Quantizes SmolLM2-135M-Instruct to FP8 and to INT4 (the default group/symmetry) into ``./out/``
(overwriting earlier demo outputs), inspects both checkpoints and prints the bytes saved.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

OUT = Path("out")
RUNS = (("--fp8", "smollm2-fp8"), ("--int4", "smollm2-int4"))


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main() -> int:
    import torch

    from compress.cli import main as compress
    from compress.inspection import inspect_checkpoint
    from compress.model_source import resolve_model

    torch.set_num_threads(min(4, os.cpu_count() or 1))
    source = resolve_model("smollm2")
    print(f"default model: SmolLM2-135M-Instruct at {source}\n")
    for flag, name in RUNS:
        print(f"$ compress quantize smollm2 {flag} -o {OUT / name} --force")
        if compress(["quantize", "smollm2", flag, "-o", str(OUT / name), "--force"]) != 0:
            return 1
        print(f"\n$ compress inspect {OUT / name}")
        if compress(["inspect", str(OUT / name)]) != 0:
            return 1
        print()
    src_bytes = _dir_bytes(source)
    bf16 = inspect_checkpoint(source).num_params * 2
    print(f"bytes saved (source {src_bytes / 2**20:,.1f} MiB as stored in fp32; {bf16 / 2**20:,.1f} MiB in bf16):")
    for flag, name in RUNS:
        out_bytes = _dir_bytes(OUT / name)
        print(f"  {name:<14} {out_bytes / 2**20:8,.1f} MiB: {(src_bytes - out_bytes) / 2**20:,.1f} MiB saved vs the source, "
              f"{bf16 / out_bytes:.2f}x smaller than bf16 (embeddings and norms stay fp32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
