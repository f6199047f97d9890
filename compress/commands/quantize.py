"""`compress quantize MODEL (--fp8 | --int8 | --int4) -o OUT`: round-to-nearest weight quantization."""
from __future__ import annotations

import argparse


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint directory, .gguf file, or a known name (smollm2, gemma3-270m)")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--fp8", dest="kind", action="store_const", const="fp8",
                      help="FP8 E4M3 per-channel weights + dynamic per-token FP8 activations (FP8_DYNAMIC)")
    kind.add_argument("--int8", dest="kind", action="store_const", const="int8",
                      help="INT8 weight-only, per-channel symmetric by default (W8A16, pack-quantized)")
    kind.add_argument("--int4", dest="kind", action="store_const", const="int4",
                      help="INT4 weight-only, group-wise (W4A16[_ASYM], pack-quantized); default group 64 asymmetric")
    p.add_argument("--group-size", type=int, default=None, metavar="N",
                   help="INT8/INT4: input columns per scale (must divide every quantized layer's input features)")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--symmetric", dest="symmetric", action="store_const", const=True, default=None)
    sym.add_argument("--asymmetric", dest="symmetric", action="store_const", const=False)
    p.add_argument("--ignore", action="append", default=None, metavar="MODULE",
                   help="Linear module left unquantized: exact name or 're:REGEX' (repeatable; default: lm_head)")
    p.add_argument("-o", "--output", required=True, help="output checkpoint directory")
    p.add_argument("--force", action="store_true", help="overwrite an existing output directory")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    from compress.model_source import resolve_model
    from compress.quantize import DEFAULT_IGNORE, quantize_checkpoint
    from compress.schemes import default_scheme
    from compress.summary import quantize_table, totals

    scheme = default_scheme(args.kind).with_options(group_size=args.group_size, symmetric=args.symmetric)
    source = resolve_model(args.model)
    ignore = tuple(args.ignore) if args.ignore else DEFAULT_IGNORE
    result = quantize_checkpoint(source, args.output, scheme, ignore=ignore, force=args.force,
                                 progress=not args.no_progress)
    t = totals(result.stats)
    src_dtypes = sorted({s.source_dtype for s in result.stats if not s.quantized})
    print(f"scheme: {scheme.describe()}, {result.algorithm}; ignore: {', '.join(result.ignore)}")
    print(quantize_table(result.stats))
    print(
        f"total {t['bytes_before'] / 2**20:,.1f} MiB -> {t['bytes_after'] / 2**20:,.1f} MiB "
        f"({t['ratio_vs_bf16']:.2f}x smaller than bf16 overall; quantized Linears "
        f"{t['quantized_ratio_vs_bf16']:.2f}x). Ratios count every parameter at 2 bytes (bf16) "
        f"whatever its stored dtype; unquantized tensors keep their source dtype ({', '.join(src_dtypes)}), "
        "scales take the weight's dtype."
    )
    print(f"wrote {result.out} in {result.seconds:.1f} s")
    return 0
