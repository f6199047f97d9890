"""`compress export CKPT --gguf [auto|q8_0|q4_1|q4_0] -o OUT.gguf`: a llama.cpp / Ollama file."""
from __future__ import annotations

import argparse


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint directory (Llama architecture; quantized by `compress quantize` or "
                                      "not), or a known name (smollm2)")
    p.add_argument("--gguf", nargs="?", const="auto", required=True, choices=("auto", "q8_0", "q4_1", "q4_0"),
                   help="GGML type of the Linears (default auto: the type that holds the checkpoint's codes exactly; "
                        "an unquantized checkpoint keeps its float dtype)")
    p.add_argument("--requantize", action="store_true",
                   help="let gguf re-quantize (round-to-nearest) Linears whose codes the type cannot hold exactly")
    p.add_argument("--embeddings", choices=("float", "q8_0"), default="float",
                   help="the token embedding (and an untied lm_head): kept in its float dtype (default), or "
                        "quantized by gguf to q8_0 as llama.cpp's own 4-bit files store it (half the bytes of bf16)")
    p.add_argument("--tokenizer-pre", default=None, metavar="NAME",
                   help="llama.cpp's pre-tokenizer name, for a tokenizer.json kvslim does not recognise")
    p.add_argument("-o", "--output", required=True, help="the .gguf file to write")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")


def run(args: argparse.Namespace) -> int:
    from compress.gguf_export import export_gguf
    from foundation.model_source import resolve_model

    done = export_gguf(resolve_model(args.checkpoint), args.output, args.gguf, args.requantize, args.tokenizer_pre, args.force,
                       args.embeddings)
    types = sorted({t.ggml_type.name for t in done.tensors if len(t.shape) == 2 and t.gguf_name.startswith("blk.")})
    linears = [t for t in done.tensors if t.gguf_name.startswith("blk.") and len(t.shape) == 2]
    parts = [f"{sum(t.source == s for t in linears)} {label}" for s, label in
             (("exact", "codes kept exactly"), ("float", "kept in float"), ("gguf-quantized", "quantized by gguf"),
              ("requantized", "re-quantized by gguf")) if any(t.source == s for t in linears)]
    embed = next(t for t in done.tensors if t.gguf_name == "token_embd.weight")
    print(f"wrote {done.path} ({done.file_bytes / 2**20:.1f} MiB): Linears {'/'.join(types)}: {', '.join(parts)}; "
          f"embedding {embed.ggml_type.name}; pre-tokenizer {done.tokenizer_pre}")
    if done.max_scale_rel_change or done.max_offset_rel_change:
        print(f"note: fp16 block scales round the checkpoint's scales by up to {done.max_scale_rel_change:.2e} "
              f"(relative; offsets {done.max_offset_rel_change:.2e}); store scales in bfloat16/float16 "
              "(`compress quantize --dtype bfloat16`) for an exact export")
    for note in done.notes:
        print(f"note: {note}")
    return 0
