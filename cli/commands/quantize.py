"""`compress quantize MODEL (--fp8 | --fp8-weight-only | --w8a8 | --int8 | --int4) -o OUT`: RTN or GPTQ weight quantization."""
from __future__ import annotations

import argparse

from compress.smoothing_spec import DEFAULT_ALPHA


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
                      help="INT4 weight-only, group-wise (W4A16[_ASYM], pack-quantized); default group 32 asymmetric")
    p.add_argument("--group-size", type=int, default=None, metavar="N",
                   help="INT8/INT4: input columns per scale (must divide every quantized layer's input features)")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--symmetric", dest="symmetric", action="store_const", const=True, default=None)
    sym.add_argument("--asymmetric", dest="symmetric", action="store_const", const=False)
    p.add_argument("--ignore", action="append", default=None, metavar="MODULE",
                   help="Linear module left unquantized: exact name or 're:REGEX' (repeatable; default: lm_head)")
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
                   help="calibration text: a calib range (default wikipedia:calib) or a UTF-8 text file")
    p.add_argument("--num-calib-samples", type=int, default=None, metavar="N",
                   help="calibration windows (default 64)")
    p.add_argument("--calib-seq-len", type=int, default=None, metavar="L",
                   help="tokens per calibration window (default 512)")
    p.add_argument("--tune-scales-steps", type=int, default=None, metavar="S",
                   help="after quantizing, tune every scale end to end for S steps (KL to the original's "
                        "logits on the calibration windows, 4 windows a step); weight-only schemes; holds "
                        "the model in memory twice")
    p.add_argument("--smooth", type=float, nargs="?", const=DEFAULT_ALPHA, default=None, metavar="ALPHA",
                   help="--w8a8 / --fp8: SmoothQuant first, moving activation outliers into the weights "
                        f"(migration strength ALPHA in (0, 1], default {DEFAULT_ALPHA}); calibrates on --calib")
    p.add_argument("--kv-cache-fp8", action="store_true",
                   help="calibrate per-layer FP8 k_scale/v_scale and declare kv_cache_scheme")
    p.add_argument("-o", "--output", required=True, help="output checkpoint directory")
    p.add_argument("--force", action="store_true", help="overwrite an existing output directory")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    import torch

    from compress.quantize import DEFAULT_IGNORE, open_source, quantize_checkpoint
    from compress.summary import quantize_table, totals
    from foundation.model_source import resolve_model
    from foundation.schemes import default_scheme

    scheme = default_scheme(args.kind).with_options(group_size=args.group_size, symmetric=args.symmetric)
    source = resolve_model(args.model)
    checkpoint = open_source(source)  # a damaged source is refused before calibration or any output
    ignore = tuple(args.ignore) if args.ignore else DEFAULT_IGNORE
    _check_flags(args, scheme, checkpoint, ignore)
    smoothed, smooth_note = _smoothed(args, scheme, source, checkpoint)
    quantizer, kv_cache_scheme, calib_note, act_order, calib_ids = _calibrated(args, scheme, source, smoothed)
    if act_order:
        from compress.algorithms.gptq import with_act_order

        scheme = with_act_order(scheme)
    tuning = _scale_tuning(args, scheme, source, calib_ids)
    result = quantize_checkpoint(smoothed or source, args.output, scheme, ignore=ignore, quantizer=quantizer,
                                 force=args.force, progress=not args.no_progress,
                                 kv_cache_scheme=kv_cache_scheme,
                                 dtype=None if args.dtype is None else getattr(torch, args.dtype),
                                 finish=tuning[0] if tuning else None)
    t = totals(result.stats)
    src_dtypes = sorted({s.source_dtype for s in result.stats if not s.quantized})
    print(f"scheme: {scheme.describe()}, {result.algorithm}; ignore: {', '.join(result.ignore)}")
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
    from compress.transformers_compat import loading_note

    for note in (smooth_note, calib_note, loading_note(scheme)):
        if note:
            print(note)
    if tuning:
        print(tuning[1][0])
    print(f"wrote {result.out} in {result.seconds:.1f} s")
    return 0


def _check_flags(args: argparse.Namespace, scheme, checkpoint, ignore) -> None:
    """Refuse a flag combination that cannot run before any calibration pass or output."""
    from pathlib import Path

    from compress.quantize import plan_linears
    from compress.smoothing_spec import SmoothingSpec
    from foundation.atomic import check_output_dir
    from foundation.errors import KvslimError

    check_output_dir(Path(args.output).expanduser().resolve(), args.force)
    plan_linears(checkpoint, scheme, ignore)
    if args.smooth is not None:
        SmoothingSpec(args.smooth).check()
        if scheme.input_activations is None:
            raise KvslimError(f"--smooth moves activation outliers into the weights; {scheme.name} keeps "
                              "activations unquantized (use --w8a8 or --fp8)")
    gptq_flags = [f for f, v in (("--act-order", args.act_order), ("--dampening", args.dampening),
                                 ("--observer", args.observer)) if v is not None]
    if args.method != "gptq" and gptq_flags:
        raise KvslimError(f"{gptq_flags[0]} is a GPTQ option; add --method gptq")
    calib_flags = [f for f, v in (("--calib", args.calib), ("--num-calib-samples", args.num_calib_samples),
                                  ("--calib-seq-len", args.calib_seq_len)) if v is not None]
    calibrates = (args.method == "gptq" or args.kv_cache_fp8 or args.smooth is not None
                  or args.tune_scales_steps is not None)
    if calib_flags and not calibrates:
        raise KvslimError(f"{calib_flags[0]} needs calibration: add --method gptq, --kv-cache-fp8, "
                          "--smooth or --tune-scales-steps")
    if calibrates:
        _calibration_spec(args).check()
    if args.tune_scales_steps is not None:
        from compress.scale_tuning import ScaleTuningSpec, check_tunable

        ScaleTuningSpec(args.tune_scales_steps)
        check_tunable(scheme)


def _smoothed(args: argparse.Namespace, scheme, source, checkpoint):
    """``(SmoothedCheckpoint, note)`` for --smooth (flags checked by ``_check_flags``); else ``(None, "")``."""
    if args.smooth is None:
        return None, ""
    from compress.calibration import calibration_ids
    from compress.smoothing import smooth_checkpoint
    from compress.smoothing_spec import SmoothingSpec

    calib = _calibration_spec(args)
    smoothed, report = smooth_checkpoint(checkpoint, calibration_ids(source, calib), SmoothingSpec(args.smooth))
    return smoothed, f"smoothing: {report.describe()}, on {calib.describe()}"


def _calibrated(args: argparse.Namespace, scheme, source, smoothed=None):
    """``(quantizer or None, kv_cache_scheme or None, note, act_order, calibration windows or None)``
    for --method gptq / --kv-cache-fp8; unset GPTQ flags take ``default_options(scheme)``.
    ``smoothed``: the --smooth'ed source, which GPTQ and the KV scales then calibrate on.

    Flag combinations were checked by ``_check_flags``."""
    if args.method != "gptq" and not args.kv_cache_fp8:
        return None, None, "", False, None
    from dataclasses import replace

    from compress.algorithms.gptq import default_options
    from compress.calibration import calibration_ids
    from compress.kv_scales import KV_CACHE_SCHEME
    from compress.sequential_quantizer import windows_quantizer

    defaults = default_options(scheme)
    options = replace(defaults,
                      dampening=defaults.dampening if args.dampening is None else args.dampening,
                      act_order=defaults.act_order if args.act_order is None else args.act_order,
                      observer=args.observer or defaults.observer)
    spec = _calibration_spec(args)
    # The scheme's activation quantization (FP8_DYNAMIC, W8A8) is applied while calibrating, as served.
    ids = calibration_ids(source, spec)
    quantizer = windows_quantizer(smoothed or source, args.method, ids, options, kv_cache_fp8=args.kv_cache_fp8,
                                  activations=scheme.input_activations)
    what = ["GPTQ" if args.method == "gptq" else "", "FP8 KV-cache scales" if args.kv_cache_fp8 else ""]
    note = f"calibration ({' + '.join(w for w in what if w)}): {spec.describe()}"
    if args.method == "gptq":
        note += (f", dampening {options.dampening}" + (", act-order" if options.act_order else "")
                 + f", {options.observer} observer")
    if scheme.input_activations is not None:
        note += f"; inputs as served ({scheme.input_activations.describe()})"
    act_order = args.method == "gptq" and options.act_order
    return quantizer, KV_CACHE_SCHEME if args.kv_cache_fp8 else None, note, act_order, ids


def _calibration_spec(args: argparse.Namespace):
    from compress.calibration import (
        DEFAULT_CALIB_TEXT,
        DEFAULT_NUM_SAMPLES,
        DEFAULT_SEQ_LEN,
        CalibrationSpec,
    )

    return CalibrationSpec(
        args.calib or DEFAULT_CALIB_TEXT,
        DEFAULT_NUM_SAMPLES if args.num_calib_samples is None else args.num_calib_samples,
        DEFAULT_SEQ_LEN if args.calib_seq_len is None else args.calib_seq_len,
    )


def _scale_tuning(args: argparse.Namespace, scheme, source, ids=None):
    """``(finish callback, [report line])`` for --tune-scales-steps, checked before any work; else None.
    ``ids``: the calibration windows already cut for GPTQ / KV scales (the same text), if any."""
    if args.tune_scales_steps is None:
        return None
    from compress.calibration import calibration_ids
    from compress.scale_tuning import ScaleTuningSpec, check_tunable, tune_scales

    spec = ScaleTuningSpec(args.tune_scales_steps)
    check_tunable(scheme)
    calib = _calibration_spec(args)
    if ids is None:
        ids = calibration_ids(source, calib)
    reports: list = []

    def finish(tmp) -> None:
        report = tune_scales(source, tmp, ids, spec, progress=not args.no_progress)
        reports.append(f"{report.describe()}; on {calib.describe()}")

    return finish, reports
