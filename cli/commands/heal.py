"""`compress heal`: distil the original model into a converted one (KL on logits, optionally hidden states)."""
from __future__ import annotations

import argparse


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("converted", help="a `compress convert` output")
    p.add_argument("--teacher", required=True, help="the original model: checkpoint dir, .gguf, or smollm2")
    p.add_argument("-o", "--out", required=True, help="output checkpoint directory")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--steps", type=int, metavar="S", help="optimizer steps")
    budget.add_argument("--minutes", type=float, metavar="M", help="training time budget in minutes")
    p.add_argument("--data", metavar="TEXT_OR_FILE",
                   help="training text: wikipedia:heal (default), a UTF-8 file, or self (the teacher's sampled "
                        "continuations of calibration prompts, seeded: the same text on every run)")
    p.add_argument("--train", choices=("attn", "all", "lora"), default="attn",
                   help="attn: attention projections of the rewritten layers (default); all; lora: adapters on those")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (warmup, then cosine); default 2e-4 when the rewrite merged KV heads "
                        "(GQA/MQA), else 5e-4")
    p.add_argument("--optim", choices=("adamw", "adamw8bit"), default="adamw",
                   help="adamw: torch's (8 bytes of state per trained parameter); adamw8bit: bitsandbytes' 8-bit "
                        "AdamW (2 bytes), for healing larger models in less memory")
    p.add_argument("--local-steps", type=int, default=0, metavar="N",
                   help="first N steps: fit each rewritten attention to the teacher's on the teacher's inputs "
                        "(layer-local reconstruction: no lm_head, no MLP backward), then distil end to end")
    p.add_argument("--hidden-weight", type=float, default=0.0, metavar="W",
                   help="add W x hidden-state matching (every layer's output, relative error per token) to the KL")
    p.add_argument("--eval-tokens", type=int, default=2048,
                   help="perplexity on this many wikipedia:eval tokens before and after (0: skip)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output")


def spec_from_args(args: argparse.Namespace):
    from attention_variants.heal import HealSpec

    return HealSpec(steps=args.steps, minutes=args.minutes, data=args.data, train=args.train, device=args.device,
                    seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, optim=args.optim,
                    hidden_weight=args.hidden_weight, local_steps=args.local_steps)


def run(args: argparse.Namespace) -> int:
    from attention_variants.heal import heal
    from attention_variants.summary import eval_perplexity
    from foundation.errors import KvslimError
    from foundation.model_source import resolve_model

    if args.eval_tokens < 0:
        raise KvslimError(f"--eval-tokens must be 0 (skip) or positive, got {args.eval_tokens}")
    teacher = resolve_model(args.teacher)
    result = heal(resolve_model(args.converted), teacher, spec_from_args(args), args.out, force=args.force)
    print(f"healed {args.converted} -> {result.out}: {result.steps} steps, {result.tokens} tokens of {result.data}, "
          f"{result.train_seconds / 60:.1f} min on {args.device}, peak lr {result.lr:g}, {args.optim} state "
          f"{result.optimizer_bytes / 2**20:.1f} MiB"
          + (f" (resumed at step {result.resumed_from})" if result.resumed_from else ""))
    what = "KL, nats/token" + (f" + {args.hidden_weight:g} x hidden-state error" if args.hidden_weight else "")
    if args.local_steps:
        print(f"  layer-local loss (attention-output error, relative): {result.local_first_loss:.4f} -> "
              f"{result.local_last_loss:.4f}")
    print(f"  distillation loss ({what}): {result.first_loss:.4f} -> {result.last_loss:.4f}")
    if args.eval_tokens > 0:
        print(f"  before: {eval_perplexity(resolve_model(args.converted), args.eval_tokens).describe()}")
        print(f"  after:  {eval_perplexity(result.out, args.eval_tokens).describe()}")
    return 0
