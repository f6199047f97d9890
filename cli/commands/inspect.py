"""`compress inspect CKPT`: architecture, attention layout, scheme, bytes, KV per token, vLLM fit.

A checkpoint whose tensors do not match its config (missing, misshapen, wrong dtype) is refused
with one line naming the tensor (``foundation.tensor_shapes``); tensors the kvslim runtime would not
read are listed in the report."""
from __future__ import annotations

import argparse


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint directory, .gguf file, or a known name (smollm2, gemma3-270m)")
    p.add_argument("--per-layer", action="store_true", help="list every quantized Linear, not one line per shape")


def run(args: argparse.Namespace) -> int:
    from compress.inspection import format_inspection, inspect_checkpoint
    from foundation.model_source import resolve_model

    print(format_inspection(inspect_checkpoint(resolve_model(args.checkpoint)), per_layer=args.per_layer))
    return 0
