"""`compress convert`: rewrite attention into MQA/GQA, cross-layer KV sharing, hybrid sliding window, sinks."""
from __future__ import annotations

import argparse


def _layer_list(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        layers = ()
    if not layers:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer indices, got {text!r}")
    return layers


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="checkpoint dir, .gguf file, or smollm2 / gemma3-270m")
    p.add_argument("-o", "--out", required=True, help="output checkpoint directory")
    heads = p.add_mutually_exclusive_group()
    heads.add_argument("--kv-heads", type=int, metavar="N", help="merge KV heads down to N per layer (GQA)")
    heads.add_argument("--mqa", action="store_true", help="one KV head per layer (same as --kv-heads 1)")
    p.add_argument("--merge", choices=("calib", "mean"), default="calib",
                   help="calib: merges/refits fitted on calibration text, folded into q_proj/o_proj (default); "
                        "mean: mean-pool KV heads, KV-sharing readers use the supplier's K/V as is")
    p.add_argument("--kv-share", type=int, metavar="K", help="share K/V in groups of K consecutive layers")
    p.add_argument("--kv-share-select", choices=("first", "calib"), default="first",
                   help="first: fixed groups read from their first layer; calib: place groups by calibration")
    p.add_argument("--sliding-window", type=int, metavar="W", help="local attention with window W on non-global layers")
    glob = p.add_mutually_exclusive_group()
    glob.add_argument("--global-every", type=int, metavar="G", help="one global layer in G (layers G-1, 2G-1, ...)")
    glob.add_argument("--global-layers", type=_layer_list, metavar="i,j,...", help="these layers stay global")
    p.add_argument("--sinks", type=int, metavar="S", default=None,
                   help="sliding layers also attend to the first S tokens (attention sinks; default 4 with "
                        "--sliding-window, 0 turns them off)")
    p.add_argument("--global-select", choices=("fixed", "calib"), default="fixed",
                   help="calib: choose as many global layers by attention mass beyond W on calibration text")
    p.add_argument("--calib", metavar="TEXT_OR_FILE", help="calibration text: wikipedia:calib (default) or a file")
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
    spec = ConvertSpec(
        kv_heads=1 if args.mqa else args.kv_heads,
        kv_share=args.kv_share,
        kv_share_select=args.kv_share_select,
        sliding_window=args.sliding_window,
        global_every=args.global_every,
        global_layers=args.global_layers,
        global_select=args.global_select,
        sinks=args.sinks if args.sinks is not None else DEFAULT_SINKS if args.sliding_window else 0,
        merge=args.merge,
        calib=args.calib,
    )
    if args.eval_tokens < 0:
        raise KvslimError(f"--eval-tokens must be 0 (skip) or positive, got {args.eval_tokens}")
    source = resolve_model(args.model)
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
