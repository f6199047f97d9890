"""`compress eval CKPT`: lm-eval tasks + perplexity on the offline pack, with recovery gates.

Scores of each (checkpoint content, task set, limits) are cached as JSON, so a baseline is measured
once. With ``--baseline``, every task's recovery is checked against ``eval/gates.yaml``; the command
exits 1 when a gate fails. ``--text FILE`` scores perplexity on a user's own text, ``--ctx N`` sets
every perplexity entry's context, ``--json PATH`` writes everything measured.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from foundation.errors import KvslimError
from runtime.cache.kv_dtype_choices import KV_CACHE_DTYPE_HELP, kv_cache_dtype_arg
from runtime.device_choices import DEVICE_HELP, DEVICES, KERNELS, KERNELS_HELP
from runtime.model.layers.dtype_choices import DTYPE_CHOICES, DTYPE_HELP


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory, .gguf file or model name (smollm2)")
    p.add_argument(
        "--tasks", nargs="+", metavar="TASK",
        help="tasks (space or comma separated); default: all 8 lm-eval tasks + ppl_wikipedia + ppl_pydoc + "
             "passkey + needle (retrieval; also needle_pydoc, multikey, and *_calib variants for tuning)",
    )
    p.add_argument("--retrieval-contexts", type=int, nargs="+", metavar="N",
                   help="prompt lengths in tokens of the retrieval tasks (default 1024 2048)")
    p.add_argument("--retrieval-samples", type=int, metavar="N",
                   help="prompts per retrieval task, length and depth (default 4: one miss is 25 points at a depth)")
    p.add_argument("--limit", type=int, help="docs per lm-eval task (default: fixed per-task limits, see BENCHMARKS.md)")
    p.add_argument("--ppl-tokens", type=int,
                   help="tokens per perplexity entry (default 8192 of a named text, all of a --text file)")
    p.add_argument("--text", metavar="FILE",
                   help="also score perplexity on this UTF-8 text file (entry ppl_text); without --tasks, only that")
    p.add_argument("--ctx", type=int, metavar="N",
                   help="context of every perplexity entry, stride N/2 (default 512; at most the model's positions)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write every result (and gates) to this JSON file")
    p.add_argument("--baseline", metavar="CKPT", help="compare against this checkpoint and apply the recovery gates")
    p.add_argument("--scheme", default="default", help="which gates of eval/gates.yaml apply (default: default)")
    p.add_argument("--backend", default="hf", help="model backend: hf (lm-eval's own transformers model) or kvslim (kvslim's engine: as served)")
    p.add_argument("--batch-size", type=int, default=8, help="lm-eval batch size (default 8)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help=f"--backend kvslim {DTYPE_HELP} (the hf backend runs float32)")
    p.add_argument("--kv-cache-dtype", default="auto", type=kv_cache_dtype_arg,
                   help=f"--backend kvslim {KV_CACHE_DTYPE_HELP}")
    p.add_argument("--device", default="auto", choices=DEVICES, help=f"--backend kvslim: {DEVICE_HELP}")
    p.add_argument("--kernels", default="auto", choices=KERNELS, help=f"--backend kvslim: {KERNELS_HELP}")
    p.add_argument("--no-cache", action="store_true", help="re-run even when cached results exist")


def _task_list(raw: list[str] | None) -> list[str] | None:
    if raw is None:
        return None
    tasks = [t.strip() for item in raw for t in item.split(",") if t.strip()]
    if not tasks:
        raise KvslimError("--tasks: no task names given")
    return tasks


def _checked_checkpoint(model_arg: str, context: int | None = None) -> Path:
    """Resolve ``model_arg`` and open it (truncated files, missing config: one-line errors) before any
    work; refuse a perplexity ``context`` longer than its positions."""
    from foundation.checkpoint import Checkpoint
    from foundation.model_source import resolve_model

    path = resolve_model(model_arg).resolve()
    positions = Checkpoint.open(path).config.get("max_position_embeddings")
    if context is not None and positions is not None and context > int(positions):
        raise KvslimError(f"--ctx {context} is longer than the model's {positions} positions (max_position_embeddings)")
    return path


def _check_json_path(path: Path | None) -> None:
    """Refuse a --json path that cannot be written before any work, not after a long run."""
    if path is None:
        return
    if path.is_dir():
        raise KvslimError(f"--json {path}: is a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KvslimError(f"--json {path}: cannot create its directory ({e.strerror})") from None


def write_json(path: Path, results, baseline=None, gates=None) -> None:
    """Every score (and the baseline's and the gates, when run) as one JSON file, written atomically."""
    doc = {"results": json.loads(results.to_json())}
    if baseline is not None:
        doc["baseline"] = json.loads(baseline.to_json())
    if gates is not None:
        doc["gates"] = [asdict(g) for g in gates]
    from foundation.atomic import write_text_atomic

    try:
        write_text_atomic(path, json.dumps(doc, indent=2, sort_keys=True))
    except OSError as e:
        raise KvslimError(f"--json {path}: cannot write it ({e.strerror})") from None


def _fmt(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def print_scores(results, path) -> None:
    from eval.retrieval_task import RETRIEVAL_TASKS, by_depth_line, contexts_run, depth_accuracies, metric_name

    print(
        f"{results.checkpoint}  sha256 {results.checkpoint_sha256[:12]}  backend {results.backend}  "
        f"{results.seconds:.0f} s wall, {results.cpu_seconds:.0f} s cpu"
    )
    print(f"{'task':<16}{'metric':<12}{'value':>10}{'stderr':>10}{'n':>7}  detail")
    for s in results.scores.values():
        digits = 3 if s.metric == "perplexity" else 4
        print(f"{s.task:<16}{s.metric:<12}{_fmt(s.value, digits):>10}{_fmt(s.stderr):>10}{s.num_samples:>7}  {s.detail}")
        if s.task in RETRIEVAL_TASKS:
            for ctx in contexts_run(s.metrics):
                line = by_depth_line(depth_accuracies(s.metrics, ctx))
                print(f"{'':<16}@{ctx:<11}{_fmt(s.metrics[metric_name(ctx)]):>10}  by depth {line}")
    print(f"results: {path}")


def print_gates(gates, scheme: str) -> None:
    print(f"recovery vs baseline, gates of scheme {scheme}")
    print(f"{'task':<16}{'metric':<12}{'baseline':>10}{'value':>10}{'recovery':>10}{'min':>7}  gate")
    for g in gates:
        verdict = "not gated" if g.passed is None else ("pass" if g.passed else "FAIL")
        print(
            f"{g.task:<16}{g.metric:<12}{g.baseline:>10.4f}{g.candidate:>10.4f}{g.recovery:>10.4f}"
            f"{g.threshold:>7.2f}  {verdict} ({g.reason})"
        )


def run(args: argparse.Namespace) -> int:
    from eval.cached_evaluation import evaluate_cached
    from eval.gates import GateConfig, all_passed, check_gates
    from eval.lm_eval_runner import BACKENDS, EvalPlan
    from eval.perplexity_task import check_perplexity_tokens

    if args.backend not in BACKENDS:
        raise KvslimError(f"unknown backend {args.backend!r}; known: {', '.join(BACKENDS)}")
    if args.batch_size < 1:
        raise KvslimError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.ppl_tokens is not None and args.ppl_tokens < 2:
        raise KvslimError(f"--ppl-tokens must be >= 2, got {args.ppl_tokens}")
    gate_cfg = GateConfig.load(args.scheme)
    if args.baseline is None and args.scheme != "default":
        raise KvslimError(f"--scheme {args.scheme} chooses recovery gates: it needs --baseline CKPT")
    if args.kv_cache_dtype != "auto" and args.backend != "kvslim":
        raise KvslimError("--kv-cache-dtype applies to --backend kvslim (the hf backend keeps transformers' cache)")
    if (args.device, args.kernels) != ("auto", "auto") and args.backend != "kvslim":
        raise KvslimError("--device / --kernels apply to --backend kvslim")
    plan = EvalPlan.make(_task_list(args.tasks), args.limit, args.ppl_tokens, args.batch_size, args.dtype,
                         args.kv_cache_dtype, args.ctx, args.text, args.device, args.kernels,
                         tuple(args.retrieval_contexts) if args.retrieval_contexts else None, args.retrieval_samples)
    _check_json_path(args.json)
    ckpt = _checked_checkpoint(args.checkpoint, args.ctx)
    baseline = _checked_checkpoint(args.baseline, args.ctx) if args.baseline is not None else None
    ppl_tasks = plan.perplexity_tasks()
    if args.ppl_tokens is not None and ppl_tasks:
        from transformers import AutoTokenizer

        check_perplexity_tokens(AutoTokenizer.from_pretrained(str(ckpt)), ppl_tasks, args.ppl_tokens)

    results, path = evaluate_cached(ckpt, plan, args.backend, not args.no_cache)
    print_scores(results, path)
    if baseline is None:
        if args.json:
            write_json(args.json, results)
        return 0
    base, base_path = evaluate_cached(baseline, plan, args.backend, not args.no_cache)
    print()
    print_scores(base, base_path)
    print()
    gates = check_gates(base, results, gate_cfg)
    print_gates(gates, gate_cfg.scheme)
    if args.json:
        write_json(args.json, results, base, gates)
    if not all_passed(gates):
        failed = ", ".join(g.task for g in gates if g.passed is False)
        print(f"compress eval: recovery gate failed: {failed}", file=sys.stderr)
        return 1
    return 0
