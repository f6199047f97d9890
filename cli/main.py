"""`compress`: the command-line front door.

Each subcommand lives in ``cli/commands/<name>.py`` with ``add_parser(subparsers)`` and
``run(args) -> int``. Command modules import heavy libraries (torch, transformers) inside
``run`` only, so ``compress --help`` stays fast. User errors (``KvslimError``) print one line on stderr and exit with code 2.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from foundation.errors import KvslimError

# name -> one-line help. Order is the order of `compress --help`.
COMMANDS: dict[str, str] = {
    "quantize": "quantize weights to FP8 / INT8 / INT4 (compressed-tensors)",
    "export": "write a llama.cpp / Ollama GGUF file from a checkpoint, keeping its quantized codes",
    "inspect": "describe a checkpoint: layout, scheme, bytes, KV per token, vLLM kernel fit",
    "generate": "continue a prompt with the kvslim runtime (--stats: weight and KV bytes)",
    "convert": "rewrite attention: MQA/GQA, cross-layer KV sharing, hybrid sliding window, attention sinks",
    "heal": "distil the original model into a converted one (recover quality)",
    "serve": "serve a checkpoint over an OpenAI-compatible HTTP API (streaming, /metrics)",
    "bench": "benchmarks: `bench serve` load-tests a running server (TTFT, TPOT, ITL, tok/s)",
    "eval": "lm-eval tasks + perplexity on the offline pack; --baseline applies recovery gates",
    "report": "compare checkpoints: weight/KV bytes, KV capacity, perplexity, accuracy, decode tok/s (table + PNG)",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own usage errors: one line, exit 2
        sys.stderr.write(f"compress: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="compress", description="kvslim: compress, rewrite, serve and evaluate LLMs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"cli.commands.{name}")
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_parser(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except KvslimError as e:
        sys.stderr.write(f"compress {args.command}: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("compress: interrupted\n")
        return 130
    except BrokenPipeError:  # e.g. `compress inspect CKPT | head`: the reader left, nothing is wrong
        try:  # no second BrokenPipeError when the interpreter flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141


if __name__ == "__main__":
    raise SystemExit(main())
