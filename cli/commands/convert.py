"""`compress convert`: rewrite attention into MQA/GQA, cross-layer KV sharing, hybrid sliding window, sinks,
streaming heads."""
from __future__ import annotations

import argparse
from pathlib import Path


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        layers = ()
    if not layers:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {text!r}")
    return layers


def _fraction_or_auto(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction of the KV heads in [0, 1] or auto, got {text!r}") from None


def plan_kv_dtype_arg(text: str) -> str:
    """A KV dtype the planner may choose: one name, or FULL/WINDOWED (``foundation.kv_dtype_mix``)."""
    from foundation.errors import KvslimError
    from foundation.kv_dtype_mix import KvDtypeMix
    from foundation.kv_plan_file import PLANNER_KV_CHOICES

    try:
        return KvDtypeMix.parse(text, PLANNER_KV_CHOICES).name
    except KvslimError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint dir, .gguf file, or smollm2 / gemma3-270m")
    p.add_argument("-o", "--out", required=True, help="output checkpoint directory")
    heads = p.add_mutually_exclusive_group()
    heads.add_argument("--kv-heads", type=int, metavar="N", help="merge KV heads down to N per layer (GQA)")
    heads.add_argument("--mqa", action="store_true", help="one KV head per layer (same as --kv-heads 1)")
    p.add_argument("--merge", choices=("calib", "aligned", "mean"), default="calib",
                   help="calib: merges/refits fitted on calibration text, folded into q_proj/o_proj (default); "
                        "aligned: KV heads grouped by similarity and rotated onto each other on calibration "
                        "text (exact), then mean-pooled; mean: mean-pool KV heads, KV-sharing readers use "
                        "the supplier's K/V as is (also with aligned)")
    p.add_argument("--kv-share", type=int, metavar="K", help="share K/V in groups of K consecutive layers")
    p.add_argument("--kv-share-select", choices=("first", "calib"), default="first",
                   help="first: fixed groups read from their first layer; calib: place groups by calibration")
    p.add_argument("--sliding-window", type=int, metavar="W",
                   help="local attention with window W on non-global layers, or on the streaming heads")
    glob = p.add_mutually_exclusive_group()
    glob.add_argument("--global-every", type=int, metavar="G", help="one global layer in G (layers G-1, 2G-1, ...)")
    glob.add_argument("--global-layers", type=_layer_list, metavar="i,j,...", help="these layers stay global")
    p.add_argument("--sinks", type=int, metavar="S", default=None,
                   help="sliding layers (or streaming heads) also attend to the first S tokens (attention sinks; "
                        "default 4 with --sliding-window, 0 turns them off)")
    p.add_argument("--streaming-heads", type=_fraction_or_auto, metavar="FRACTION|auto",
                   help="this share of all KV heads (lowest-scored on calibration text, across layers) attends to "
                        "the sinks + the last W tokens only, the rest to everything (DuoAttention); auto: 0.5 for "
                        "GQA models, 0.75 for MHA")
    p.add_argument("--streaming-select", choices=("mass", "output"), default="mass",
                   help="head score: mass = attention beyond the window (sink keys counted lost); output = the "
                        "layer's attention-output change when the head alone streams")
    p.add_argument("--global-select", choices=("fixed", "calib"), default="fixed",
                   help="calib: choose as many global layers by attention mass beyond W on calibration text")
    p.add_argument("--calib", metavar="TEXT_OR_FILE", help="calibration text: wikipedia:calib (default) or a file")
    plan = p.add_mutually_exclusive_group()
    plan.add_argument("--kv-budget", type=float, metavar="R",
                      help="plan the KV layout and dtype: at most R of the original's KV bytes per token at --ctx "
                           "(e.g. 0.16), the lowest dev perplexity served (writes plan.json)")
    plan.add_argument("--max-ppl-increase", type=float, metavar="P",
                      help="plan the fewest KV bytes whose dev perplexity stays within P of the original's (0.1 = +10%%)")
    p.add_argument("--kv-dtypes", nargs="+", default=None, metavar="D", type=plan_kv_dtype_arg,
                   help="with --kv-budget / --max-ppl-increase: the KV dtypes the plan may choose, each bf16, int8, "
                        "int4, k4v2 or k3v2 (4- or 3-bit keys, 2-bit values), int2 or FULL/WINDOWED such as "
                        "int4/int2 (full-attention KV in the first, sliding layers' and streaming heads' in the "
                        "second) (default: bf16 int8 int4 int2)")
    plan.add_argument("--kv-cache-dtype", metavar="D",
                      help="serve the checkpoint in KV dtype D by default, weights and layout unchanged (writes "
                           "plan.json; a --kv-cache-dtype name of compress serve, variants too: int4:exact-first-block); "
                           "D:auto (e.g. int4:auto) chooses D's variant for this model: each candidate served on "
                           "calibration passkey and needle prompts at --ctx, the cheapest within 0.01 of the best "
                           "answer log-probability")
    p.add_argument("--retrieval-heads", type=float, default=None, metavar="F",
                   help="with --kv-cache-dtype HIGH/LOW (e.g. int4/int2): this share of the KV heads, those the "
                        "question's attention finds a fact through on calibration passkey and needle prompts at "
                        "--ctx, keep HIGH; the rest store LOW, every head still attending to the whole context")
    p.add_argument("--min-retrieval", type=float, default=None, metavar="P",
                   help="with --kv-budget / --max-ppl-increase: keep retrieval of a fact stated once (calibration "
                        "passkey and needle prompts at --ctx, served) within P of the original's accuracy at every "
                        "depth (default 0.05: 5 points; 1: no retrieval bound)")
    p.add_argument("--max-logprob-drop", type=float, default=None, metavar="NATS",
                   help="with the retrieval bound: on every calibration prompt the original answers, the answer's "
                        "mean log-probability per token may fall at most NATS below the original's (default "
                        "0.693 = ln 2: at most half as likely; inf: hits alone)")
    p.add_argument("--retrieval-samples", type=int, default=None, metavar="N",
                   help="with the retrieval bound: calibration prompts per task and depth (default 1: 10 prompts, "
                        "where one miss moves a depth by 50 points; more make the bound stricter and slower); "
                        "with --kv-cache-dtype D:auto: the prompts the variant is chosen on (default 4)")
    p.add_argument("--plan-windows", type=int, nargs="+", default=None, metavar="W",
                   help="with --kv-budget / --max-ppl-increase: the sliding windows (with 4 sinks) the plan may "
                        "choose for windowed layers and streaming heads, each below --ctx (default 1024 512 256)")
    p.add_argument("--ctx", type=int, help="with --kv-budget / --max-ppl-increase: the context the plan's bytes and "
                                           "perplexity are measured at (default 2048)")
    p.add_argument("--eval-tokens", type=int, default=4096,
                   help="unhealed perplexity on this many wikipedia:eval tokens, before and after (0: skip)")
    p.add_argument("--heal-steps", type=int, metavar="S",
                   help="then heal S steps (compress heal's defaults, the original model as teacher)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output")


def run(args: argparse.Namespace) -> int:
    import torch

    from attention_variants.convert import DEFAULT_SINKS, ConvertSpec, convert
    from attention_variants.convert_and_heal import convert_and_heal
    from attention_variants.summary import eval_perplexity, print_summary
    from foundation.errors import KvslimError
    from foundation.model_source import resolve_model

    torch.set_num_threads(max(1, min(torch.get_num_threads(), 16)))
    planning = args.kv_budget is not None or args.max_ppl_increase is not None
    if args.retrieval_heads is not None and not args.kv_cache_dtype:
        raise KvslimError("--retrieval-heads F splits KV bits by head: give --kv-cache-dtype HIGH/LOW (e.g. int4/int2)")
    if args.ctx is not None and not planning and not args.kv_cache_dtype:
        raise KvslimError("--ctx applies to a KV plan (--kv-budget R, --max-ppl-increase P or --kv-cache-dtype D)")
    for flag, value in (("--min-retrieval", args.min_retrieval), ("--max-logprob-drop", args.max_logprob_drop),
                        ("--kv-dtypes", args.kv_dtypes),
                        ("--retrieval-samples", args.retrieval_samples), ("--plan-windows", args.plan_windows)):
        if flag == "--retrieval-samples" and value is not None and args.kv_cache_dtype:
            continue  # the variant choice's prompts too
        if value is not None and not planning:
            raise KvslimError(f"{flag} applies to a KV plan (--kv-budget R or --max-ppl-increase P)")
    if planning and _rewrites(args):
        raise KvslimError(f"--kv-budget / --max-ppl-increase choose the window, sinks, full layers and KV dtype "
                          f"themselves; drop {', '.join(_rewrites(args))}")
    if args.kv_cache_dtype and _rewrites(args):
        raise KvslimError(f"--kv-cache-dtype keeps the weights and layout as they are; drop {', '.join(_rewrites(args))} "
                          "(or convert first, then run --kv-cache-dtype on the result)")
    spec = ConvertSpec(
        kv_heads=1 if args.mqa else args.kv_heads,
        kv_share=args.kv_share,
        kv_share_select=args.kv_share_select,
        sliding_window=args.sliding_window,
        global_every=args.global_every,
        global_layers=args.global_layers,
        global_select=args.global_select,
        streaming_heads=args.streaming_heads,
        streaming_select=args.streaming_select,
        sinks=args.sinks if args.sinks is not None else DEFAULT_SINKS if args.sliding_window else 0,
        merge=args.merge,
        calib=args.calib,
    )
    if args.eval_tokens < 0:
        raise KvslimError(f"--eval-tokens must be 0 (skip) or positive, got {args.eval_tokens}")
    source = resolve_model(args.model)
    if planning:
        return _plan(args, source)
    if args.kv_cache_dtype:
        return _kv_dtype(args, source)
    if args.heal_steps is None:
        result = convert(source, spec, args.out, force=args.force)
        print_summary(source, result, spec, args.eval_tokens)
        return 0
    _, healed = convert_and_heal(source, spec, args.heal_steps, args.out, force=args.force,
                                 on_converted=lambda result: print_summary(source, result, spec, args.eval_tokens))
    print(f"  healed {healed.steps} steps ({healed.tokens} tokens of {healed.data}, {healed.train_seconds / 60:.1f} min): "
          f"KL {healed.first_loss:.4f} -> {healed.last_loss:.4f}")
    if args.eval_tokens > 0:
        print(f"  healed: {eval_perplexity(healed.out, args.eval_tokens).describe()}")
    return 0


def _rewrites(args: argparse.Namespace) -> list[str]:
    """The manual rewrite flags given (the planner takes none of them)."""
    given = {"--kv-heads": args.kv_heads, "--mqa": args.mqa or None, "--kv-share": args.kv_share,
             "--sliding-window": args.sliding_window, "--global-every": args.global_every,
             "--global-layers": args.global_layers, "--sinks": args.sinks, "--heal-steps": args.heal_steps,
             "--streaming-heads": args.streaming_heads}
    return [flag for flag, value in given.items() if value is not None]


def _kv_dtype(args: argparse.Namespace, source) -> int:
    """``--kv-cache-dtype D`` (or ``D:auto``): the checkpoint with plan.json naming D (or D's chosen variant)."""
    import json

    from eval.kv_plan import DEFAULT_PLAN_CTX, write_plan_beside_weights
    from eval.kv_variant_choice import CHOICE_SAMPLES, choose_kv_variant, named_kv_dtype
    from foundation.atomic import check_output_dir
    from foundation.errors import KvslimError
    from foundation.kv_dtype_mix import split_variants
    from runtime.cache.kv_dtype_choices import cache_kv_dtype

    check_output_dir(Path(args.out), args.force)
    base, how = split_variants(args.kv_cache_dtype)
    choosing = how == ("auto",)
    dtype = cache_kv_dtype(base if choosing else args.kv_cache_dtype)
    if dtype is None:
        raise KvslimError("--kv-cache-dtype auto is the serving default already; name a KV dtype (e.g. int4:auto)")
    ctx = args.ctx or DEFAULT_PLAN_CTX
    if args.retrieval_heads is not None:
        if choosing:
            raise KvslimError("--retrieval-heads takes a named KV dtype mix (e.g. int4/int2), not a variant choice (:auto)")
        return _precision_heads(args, source, dtype, ctx)
    samples = CHOICE_SAMPLES if args.retrieval_samples is None else args.retrieval_samples
    if samples < 1:
        raise KvslimError(f"--retrieval-samples must be at least 1, got {samples}")
    choice = (choose_kv_variant(source, dtype, ctx, samples, progress=lambda line: print(f"  {line}", flush=True))
              if choosing else named_kv_dtype(source, dtype, ctx))
    out = write_plan_beside_weights(source, json.dumps(choice.plan(), indent=2), args.out, force=args.force)
    c = choice.chosen
    print(f"KV {c.kv_dtype}: {c.kv_bytes_per_token:,.0f} B/token @{ctx} = {choice.times_smaller:.2f}x smaller than "
          f"the bf16 original ({choice.original_kv_bytes_per_token:,.0f})")
    print(f"  wrote {out} (plan.json: compress serve / eval --backend kvslim use {c.kv_dtype} KV by default)")
    return 0


def _precision_heads(args: argparse.Namespace, source, dtype: str, ctx: int) -> int:
    """``--kv-cache-dtype HIGH/LOW --retrieval-heads F``: KV bits per head (``eval.kv_precision_heads``)."""
    from eval.kv_precision_heads import RANKING_SAMPLES, choose_precision_heads, write_precision_heads

    samples = RANKING_SAMPLES if args.retrieval_samples is None else args.retrieval_samples
    heads = choose_precision_heads(source, dtype, args.retrieval_heads, ctx, samples,
                                   progress=lambda line: print(f"  {line}", flush=True))
    out = write_precision_heads(source, heads, args.out, force=args.force)
    print(f"KV {heads.describe()}: {heads.kv_bytes_per_token:,.0f} B/token @{ctx} = {heads.times_smaller:.2f}x smaller "
          f"than the bf16 original ({heads.original_kv_bytes_per_token:,.0f})")
    print(f"  wrote {out} (plan.json: compress serve / eval --backend kvslim use {heads.kv_dtype} KV by default)")
    return 0


def _plan(args: argparse.Namespace, source) -> int:
    from eval.kv_plan import (
        DEFAULT_PLAN_CTX,
        PLAN_DTYPES,
        PLAN_WINDOWS,
        RETRIEVAL_SAMPLES,
        plan_kv,
        write_planned_checkpoint,
    )
    from eval.retrieval_bound import DEFAULT_MAX_LOGPROB_DROP, DEFAULT_MIN_RETRIEVAL
    from eval.retrieval_task import by_depth_line
    from foundation.atomic import check_output_dir
    from foundation.errors import KvslimError

    check_output_dir(Path(args.out), args.force)
    ctx = args.ctx or DEFAULT_PLAN_CTX
    if args.plan_windows and max(args.plan_windows) >= ctx:
        raise KvslimError(f"--plan-windows {max(args.plan_windows)} is not below the plan's context {ctx} "
                          "(a window that long is full attention)")
    bound = DEFAULT_MIN_RETRIEVAL if args.min_retrieval is None else args.min_retrieval
    plan = plan_kv(source, args.kv_budget, args.max_ppl_increase, ctx, args.calib,
                   windows=tuple(dict.fromkeys(args.plan_windows)) if args.plan_windows else PLAN_WINDOWS,
                   dtypes=tuple(dict.fromkeys(args.kv_dtypes)) if args.kv_dtypes else PLAN_DTYPES,
                   progress=lambda line: print(f"  {line}", flush=True), min_retrieval=None if bound >= 1 else bound,
                   retrieval_samples=RETRIEVAL_SAMPLES if args.retrieval_samples is None else args.retrieval_samples,
                   max_logprob_drop=DEFAULT_MAX_LOGPROB_DROP if args.max_logprob_drop is None else args.max_logprob_drop)
    out = write_planned_checkpoint(source, plan, args.out, force=args.force)
    c = plan.chosen
    print(f"plan: {c.choice.describe(plan.num_layers)}")
    print(f"  KV {c.kv_bytes_per_token:,.0f} B/token @{plan.ctx} = {c.times_smaller:.2f}x smaller than the bf16 "
          f"original ({plan.original_kv_bytes_per_token:,.0f})")
    print(f"  dev perplexity {c.dev_ppl:.3f} vs {plan.original_dev_ppl:.3f} "
          f"({100 * (c.dev_ppl / plan.original_dev_ppl - 1):+.2f}%, served, {plan.dev_text})")
    if c.retrieval is not None:
        met = "within" if plan.retrieval_bound_met else "NOT within"
        print(f"  calibration retrieval by depth {plan.bound.kept(c.retrieval, plan.original_retrieval)}; the "
              f"original's {by_depth_line(plan.original_retrieval.accuracy())} ({met} the bound: "
              f"{plan.bound.describe()}; {plan.retrieval_prompts})")
    print(f"  wrote {out} (plan.json: compress serve / eval --backend kvslim use {plan.kv_cache_dtype} KV by default)")
    return 0
