"""`compress quantize MODEL (--fp8 | --fp8-weight-only | --w8a8 | --int8 | --int4) -o OUT`: RTN or GPTQ weight quantization."""
from __future__ import annotations

import argparse

from compress.quantize_options import (
    BNB_KINDS,
    DEFAULT_CALIB_SEQ_LEN,
    DEFAULT_CALIB_WINDOWS,
    DEFAULT_IGNORE,
    QuantizeOptions,
)
from compress.smoothing_spec import DEFAULT_ALPHA
from foundation.schemes import DEFAULT_INT4_GROUP_SIZE, DEFAULT_INT4_SYMMETRIC
from foundation.texts import DEFAULT_CALIB


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint directory, .gguf file, or a known name (smollm2, gemma3-270m)")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--fp8", dest="kind", action="store_const", const="fp8",
                      help="FP8 E4M3 per-channel weights + dynamic per-token FP8 activations (FP8_DYNAMIC)")
    kind.add_argument("--fp8-weight-only", dest="kind", action="store_const", const="fp8-weight-only",
                      help="FP8 E4M3 per-channel weights, activations unquantized (FP8 W8A16: vLLM's FP8 Marlin)")
    kind.add_argument("--w8a8", dest="kind", action="store_const", const="w8a8",
                      help="INT8 per-channel weights + dynamic per-token INT8 activations (W8A8, int-quantized)")
    kind.add_argument("--int8", dest="kind", action="store_const", const="int8",
                      help="INT8 weight-only, per-channel symmetric by default (W8A16, pack-quantized)")
    kind.add_argument("--int4", dest="kind", action="store_const", const="int4",
                      help="INT4 weight-only, group-wise (W4A16[_ASYM], pack-quantized); default group "
                           f"{DEFAULT_INT4_GROUP_SIZE} {'symmetric' if DEFAULT_INT4_SYMMETRIC else 'asymmetric'}")
    kind.add_argument("--nf4", dest="kind", action="store_const", const="nf4",
                      help="bitsandbytes NF4 (4-bit, blocks of 64) through transformers: for transformers + "
                           "bitsandbytes and vLLM users; the kvslim runtime does not serve it")
    kind.add_argument("--int8-bnb", dest="kind", action="store_const", const="int8-bnb",
                      help="bitsandbytes LLM.int8 through transformers (same audience as --nf4)")
    p.add_argument("--group-size", type=int, default=None, metavar="N",
                   help="INT8/INT4: input columns per scale (must divide every quantized layer's input features)")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--symmetric", dest="symmetric", action="store_const", const=True, default=None)
    sym.add_argument("--asymmetric", dest="symmetric", action="store_const", const=False)
    p.add_argument("--ignore", action="append", default=None, metavar="MODULE",
                   help="Linear module left unquantized: exact name or 're:REGEX' (repeatable; default: "
                        f"{', '.join(DEFAULT_IGNORE)})")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default=None,
                   help="cast the source's floating-point tensors first: unquantized tensors (embeddings, norms) "
                        "and scales are stored in this dtype (default: the source's own)")
    p.add_argument("--method", choices=("rtn", "gptq"), default="rtn",
                   help="rtn: round-to-nearest (default); gptq: calibrated, layer by layer")
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ: visit columns by decreasing activation energy (recorded as actorder 'weight'); "
                        "default: on for --int4, off otherwise")
    p.add_argument("--observer", choices=("minmax", "mse"), default=None,
                   help="GPTQ: scale ranges from min-max or shrunk to the least-error range (mse); "
                        "default: mse for --int4, minmax otherwise")
    p.add_argument("--dampening", type=float, default=None, metavar="F",
                   help="GPTQ: fraction of the mean Hessian diagonal added to it (default 0.01)")
    p.add_argument("--calib", default=None, metavar="TEXT",
                   help=f"calibration text: a calib range (default {DEFAULT_CALIB}) or a UTF-8 text file")
    p.add_argument("--num-calib-samples", type=int, default=None, metavar="N",
                   help=f"calibration windows (default {DEFAULT_CALIB_WINDOWS})")
    p.add_argument("--calib-seq-len", type=int, default=None, metavar="L",
                   help=f"tokens per calibration window (default {DEFAULT_CALIB_SEQ_LEN})")
    p.add_argument("--tune-scales-steps", type=int, default=None, metavar="S",
                   help="after quantizing, tune every scale end to end for S steps (KL to the original's "
                        "logits on the calibration windows, 4 windows a step); weight-only schemes; holds "
                        "the model in memory twice")
    p.add_argument("--smooth", type=float, nargs="?", const=DEFAULT_ALPHA, default=None, metavar="ALPHA",
                   help="--w8a8 / --fp8: SmoothQuant first, moving activation outliers into the weights "
                        f"(migration strength ALPHA in (0, 1], default {DEFAULT_ALPHA}); calibrates on --calib")
    p.add_argument("--kv-cache-fp8", action="store_true",
                   help="calibrate per-layer FP8 k_scale/v_scale and declare kv_cache_scheme")
    p.add_argument("--lm-head", choices=("int8", "int4", "bf16"), default=None,
                   help="store the output projection on its own: INT8 per channel or INT4 group 32 (round-to-nearest, "
                        "compressed-tensors group naming lm_head) or a bf16 copy; a tied lm_head is untied (a copy "
                        "of the embedding). Default: kept as the source has it")
    p.add_argument("-o", "--output", required=True, help="output checkpoint directory")
    p.add_argument("--force", action="store_true", help="overwrite an existing output directory")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    if args.kind in BNB_KINDS:
        return run_bnb(args)
    from compress.quantize_plan import plan_quantization, run_plan
    from compress.summary import quantize_table, totals
    from compress.transformers_compat import loading_note

    done = run_plan(plan_quantization(options_from_args(args)))
    result = done.result
    t = totals(result.stats)
    src_dtypes = sorted({s.source_dtype for s in result.stats if not s.quantized})
    print(f"scheme: {result.scheme.describe()}, {result.algorithm}; ignore: {', '.join(result.ignore)}")
    print(quantize_table(result.stats))
    print(
        f"total {t['bytes_before'] / 2**20:,.1f} MiB -> {t['bytes_after'] / 2**20:,.1f} MiB "
        f"({t['ratio_vs_bf16']:.2f}x smaller than bf16 overall; quantized Linears "
        f"{t['quantized_ratio_vs_bf16']:.2f}x). Ratios count every parameter at 2 bytes (bf16) "
        f"whatever its stored dtype; unquantized tensors "
        + (f"cast to {args.dtype} (source: {', '.join(src_dtypes)}), " if args.dtype
           else f"keep their source dtype ({', '.join(src_dtypes)}), ")
        + "scales take the weight's dtype."
    )
    for note in (done.smoothing, done.calibration, loading_note(result.scheme), done.tuning):
        if note:
            print(note)
    if args.lm_head:
        tied = done.tied_lm_head
        print(f"lm_head: {args.lm_head}" + (" as its own group" if args.lm_head != "bf16" else " copy")
              + ("; the source ties it to the embedding, so the output carries an untied copy "
                 "(tie_word_embeddings false)" if tied else ""))
    print(f"wrote {result.out} in {result.seconds:.1f} s")
    return 0


def run_bnb(args: argparse.Namespace) -> int:
    import torch

    from compress.bnb_quantize import check_bnb_options, quantize_bnb
    from foundation.model_source import resolve_model

    check_bnb_options(options_from_args(args))
    done = quantize_bnb(resolve_model(args.model), args.output, BNB_KINDS[args.kind],
                        getattr(torch, args.dtype) if args.dtype else None, args.force)
    print(f"scheme: {done.scheme.describe()}; {done.quantized_linears} Linears quantized by bitsandbytes "
          f"(lm_head kept)")
    print(f"total {done.bytes_before / 2**20:,.1f} MiB -> {done.bytes_after / 2**20:,.1f} MiB on disk")
    print("loads with transformers `from_pretrained(dir)` (bitsandbytes installed) and vLLM "
          "(`--quantization bitsandbytes`); `compress serve` / `generate` serve compressed-tensors checkpoints "
          "(--int4 / --int8)")
    print(f"wrote {done.out} in {done.seconds:.1f} s")
    return 0


def options_from_args(args: argparse.Namespace) -> QuantizeOptions:
    return QuantizeOptions(
        model=args.model, output=args.output, kind=args.kind, group_size=args.group_size,
        symmetric=args.symmetric, ignore=tuple(args.ignore) if args.ignore else None, dtype=args.dtype,
        method=args.method, act_order=args.act_order, observer=args.observer, dampening=args.dampening,
        calib=args.calib, num_calib_samples=args.num_calib_samples, calib_seq_len=args.calib_seq_len,
        tune_scales_steps=args.tune_scales_steps, smooth=args.smooth, kv_cache_fp8=args.kv_cache_fp8, lm_head=args.lm_head,
        force=args.force, progress=not args.no_progress,
    )
