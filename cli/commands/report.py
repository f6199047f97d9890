"""`compress report CKPT ... [--kv-cache-dtypes D ...] [-o DIR]`: one Markdown table, one PNG of the
figures and one Pareto PNG (KV bytes vs perplexity) comparing checkpoints.

Weight bytes, KV bytes per token, measured KV capacity, perplexity, task accuracy and recovery vs
the first row, decode tokens/s: all measured on kvslim's runtime (``eval/report.py``), one row per
checkpoint and KV dtype. Accuracy and perplexity come from ``compress eval --backend kvslim``
(cached per checkpoint and KV dtype).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from foundation.errors import KvslimError
from foundation.model_source import NAMED_MODELS, resolve_model
from runtime.cache.kv_dtype_choices import KV_CACHE_DTYPES, cache_kv_dtype, is_kv_cache_dtype, kv_cache_dtype_arg

DEFAULT_TASKS = ("arc_easy", "hellaswag", "piqa", "ppl_wikipedia", "passkey")


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoints", metavar="CKPT[@KV]", nargs="+",
                   help="checkpoint directories or model names; the first is the baseline of 'recovery'; "
                        "CKPT@int4 measures that checkpoint with that KV cache dtype only (one row)")
    p.add_argument("--names", help="comma-separated row names (default: directory names)")
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS),
                   help="comma-separated eval tasks, at most one perplexity entry; retrieval tasks (passkey, needle, "
                        f"needle_pydoc, multikey) run at --ctx; '' for none: bytes, capacity and decode alone "
                        f"(default: {','.join(DEFAULT_TASKS)})")
    p.add_argument("--limit", type=int, help="docs per lm-eval task (default: the pack's fixed per-task limits)")
    p.add_argument("--ppl-tokens", type=int, default=None,
                   help="perplexity tokens of wikipedia:eval (default: 4 contexts, so every row is scored over "
                        "several full windows)")
    p.add_argument("--kv-budget-gib", type=float, default=1.0, help="KV cache budget for the capacity column (default 1)")
    p.add_argument("--decode-batch", type=int, default=8, help="concurrent requests of the decode benchmark (default 8)")
    p.add_argument("--decode-tokens", type=int, default=32, help="new tokens per decode request (default 32)")
    p.add_argument("--decode-prompt-tokens", type=int, default=64,
                   help="prompt tokens per decode request: the context the decode steps run at (default 64)")
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], type=kv_cache_dtype_arg, metavar="D",
                   help="measure each checkpoint with each of these KV cache dtypes, one row each (default: "
                        f"auto; {', '.join(KV_CACHE_DTYPES)}, or FULL/WINDOWED such as int8/int2)")
    p.add_argument("--ctx", type=int, default=2048,
                   help="the context every figure is at: KV bytes per token and capacity at this many tokens, "
                        "perplexity over windows of this many (stride half of it) (default 2048)")
    p.add_argument("--retrieval-samples", type=int, metavar="N",
                   help="prompts per retrieval task and depth (default 4: one miss is 25 points at a depth)")
    p.add_argument("--no-cache", action="store_true", help="re-run evals even when cached results exist")
    p.add_argument("-o", "--out", default="report", help="output directory (default ./report)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output directory")


def run(args: argparse.Namespace) -> int:
    import torch

    from eval.perplexity_task import PERPLEXITY_TASKS
    from eval.report import GIB, ReportSettings, measure, write_report
    from foundation.atomic import atomic_output_dir, check_output_dir

    tasks = tuple(t for t in args.tasks.split(",") if t)
    if sum(t in PERPLEXITY_TASKS for t in tasks) > 1:
        raise KvslimError(f"--tasks: at most one perplexity entry ({', '.join(PERPLEXITY_TASKS)})")
    names = args.names.split(",") if args.names else None
    if names is not None and len(names) != len(args.checkpoints):
        raise KvslimError(f"--names has {len(names)} names for {len(args.checkpoints)} checkpoints")
    if args.ctx < 2:
        raise KvslimError(f"--ctx must be >= 2, got {args.ctx}")
    ppl_tokens = args.ppl_tokens if args.ppl_tokens is not None else 4 * args.ctx
    for flag, v in (("--decode-batch", args.decode_batch), ("--decode-tokens", args.decode_tokens),
                    ("--decode-prompt-tokens", args.decode_prompt_tokens),
                    ("--ppl-tokens", ppl_tokens)):
        if v < 2:
            raise KvslimError(f"{flag} must be >= 2, got {v}")
    if args.kv_budget_gib <= 0:
        raise KvslimError(f"--kv-budget-gib must be > 0, got {args.kv_budget_gib}")
    out = Path(args.out)
    check_output_dir(out, args.force)
    entries = [_entry(c) for c in args.checkpoints]
    paths = [resolve_model(c).resolve() for c, _ in entries]
    names = names or [p.name for p in paths]
    settings = ReportSettings(tasks=tasks, limit=args.limit, perplexity_tokens=ppl_tokens,
                              kv_budget_bytes=int(args.kv_budget_gib * GIB), decode_batch=args.decode_batch,
                              decode_new_tokens=args.decode_tokens,
                              decode_prompt_tokens=args.decode_prompt_tokens, context=args.ctx,
                              retrieval_samples=args.retrieval_samples)
    torch.set_num_threads(min(torch.get_num_threads(), 4))
    rows = []
    crossed = list(dict.fromkeys(args.kv_cache_dtypes))
    for name, path, (_, own) in zip(names, paths, entries):
        kv_dtypes = [own] if own else crossed
        for kv in kv_dtypes:
            row_name = name if len(kv_dtypes) == 1 and (own is None or args.names) else f"{name} {kv}"
            print(f"measuring {row_name} ({path})", flush=True)
            rows.append(measure(row_name, path, settings, use_cache=not args.no_cache, kv_cache_dtype=kv))
    with atomic_output_dir(out, args.force) as tmp:
        md, _ = write_report(rows, tmp, settings)
        table = md.read_text()
    print()
    print(table)
    print(f"table: {out / 'report.md'}")
    print(f"plot:  {out / 'report.png'}")
    print(f"pareto: {out / 'pareto.png'}")
    return 0


def _entry(text: str) -> tuple[str, str | None]:
    """``CKPT`` or ``CKPT@KV`` (KV a ``--kv-cache-dtype`` name; any other ``@`` is part of the path)
    -> (checkpoint, its own KV dtype or None)."""
    ckpt, at, kv = text.rpartition("@")
    if at and is_kv_cache_dtype(kv):
        return ckpt, kv
    if at and not Path(text).exists() and (ckpt in NAMED_MODELS or Path(ckpt).exists()):
        try:
            cache_kv_dtype(kv)  # raises, naming the choices
        except KvslimError as e:
            raise KvslimError(f"{text}: {e}") from None
    return text, None
