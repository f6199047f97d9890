"""`compress bench serve`: load-test an OpenAI-compatible server (see ``eval/bench_serve.py``).

    compress bench serve --base-url http://127.0.0.1:8000 --num-prompts 32 --request-rate 4 \\
        --input-len 128 --output-len 64 --json runs/serve.json
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from foundation.errors import KvslimError


def add_parser(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH", parser_class=type(p))
    sub.required = True
    s = sub.add_parser("serve", help="throughput and TTFT/TPOT/ITL of a running server under load",
                       description="Poisson arrivals of streamed completions against an OpenAI-compatible server")
    s.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    s.add_argument("--num-prompts", type=int, required=True)
    s.add_argument("--request-rate", type=float, default=float("inf"),
                   help="mean requests per second, Poisson arrivals (default inf: all at once)")
    s.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    s.add_argument("--input-len", type=int, default=None, help="prompt tokens (windows of wikipedia:eval)")
    s.add_argument("--output-len", type=int, default=128, help="tokens to generate per request")
    s.add_argument("--dataset", type=Path, default=None, help='JSONL of {"prompt": str, "output_len": int?}')
    s.add_argument("--tokenizer", default="smollm2", help="model whose tokenizer cuts the prompts")
    s.add_argument("--model", default=None, help="model id to request (default: the server's first)")
    s.add_argument("--api-key", default=None, help="bearer key (or $KVSLIM_API_KEY)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", type=Path, default=None, help="write the summary here")


def run(args: argparse.Namespace) -> int:
    from eval.bench_serve import bench_serve, format_summary, write_json

    if args.request_rate == float("inf") and args.max_concurrency is None:
        raise KvslimError("give --request-rate R or --max-concurrency C (or both)")
    if (args.input_len is None) == (args.dataset is None):
        raise KvslimError("give either --input-len/--output-len or --dataset FILE")
    if args.dataset is not None and not args.dataset.is_file():
        raise KvslimError(f"--dataset {args.dataset}: no such file")
    summary = bench_serve(
        args.base_url, args.num_prompts, args.request_rate, args.max_concurrency, args.input_len,
        args.output_len, args.dataset, args.tokenizer, seed=args.seed,
        api_key=args.api_key or os.environ.get("KVSLIM_API_KEY"), model=args.model,
    )
    print(format_summary(summary))
    if args.json is not None:
        write_json(summary, args.json)
        print(f"wrote {args.json}")
    return 0 if summary.failed == 0 else 1
