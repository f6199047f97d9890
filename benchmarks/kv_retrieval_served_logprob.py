"""Retrieval as a continuous figure, served: the key's teacher-forced log-probability per KV dtype.

A hit rate at 4 prompts a depth moves in steps of 25 points and flips on a near-tie; the
log-probability of the answer's tokens does not. Each retrieval prompt runs through the kvslim
engine with the KV cache really compressed, as `LLM` serves one request: the prompt prefilled in
chunks of ``--prefill-chunk`` (each chunk's new rows read exact), then the answer (``" " + key``)
fed one token at a time as decoded. Reported per task and depth: the mean log-probability of the
answer's tokens, and how many prompts have every one of them as the argmax (greedy's answer).
KV variants the runtime does not default to (``int4:keys-unrotated``...): ``served_kv_variant.py``.

    python benchmarks/kv_retrieval_served_logprob.py gemma3-270m --kv bf16 int4 int4:keys-unrotated \\
        --tasks passkey,needle --ctx 8192 --json runs/gemma_retrieval_logprob.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def answer_ids(tokenizer, text: str, answer: str) -> tuple[list[int], list[int]]:
    """``(prompt ids, answer ids)``: ``text`` as the runtime tokenizes a prompt, and the tokens that
    ``" " + answer`` adds after it (one-line error where the joint tokenization does not extend it)."""
    prompt = list(tokenizer(text)["input_ids"])
    full = list(tokenizer(text + " " + answer)["input_ids"])
    if full[:len(prompt)] != prompt or len(full) == len(prompt):
        raise SystemExit(f"the answer {answer!r} does not tokenize as a continuation of its prompt")
    return prompt, full[len(prompt):]


def served_pieces(prompt_tokens: int, answer_tokens: int, prefill_chunk: int) -> list[int]:
    """Token counts fed per step: the prompt in prefill chunks, then the answer one at a time."""
    chunks = [min(prefill_chunk, prompt_tokens - a) for a in range(0, prompt_tokens, prefill_chunk)]
    return chunks + [1] * answer_tokens


def answer_logprobs(engine, prompt: list[int], answer: list[int], prefill_chunk: int) -> tuple[torch.Tensor, bool]:
    """Each answer token's fp32 log-probability, teacher-forced, as served, and whether every one
    of them is the argmax (greedy decoding's answer)."""
    from foundation.perplexity import target_logprobs

    ids = prompt + answer[:-1]  # the last answer token predicts nothing
    pieces = served_pieces(len(prompt), len(answer) - 1, prefill_chunk)
    # Logits only where a position predicts an answer token: the prompt's last row, then each answer's.
    rows = torch.cat([r for _, r in engine.score_pieces(ids, pieces, logits_from=len(prompt) - 1, exact_new_rows=True)])
    targets = torch.tensor(answer, device=rows.device)
    return target_logprobs(rows, targets).cpu(), bool((rows.argmax(-1) == targets).all())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a checkpoint dir or a model name (smollm2, gemma3-270m)")
    ap.add_argument("--kv", nargs="+", default=["bf16", "int4"], help="KV dtypes, or DTYPE:HOW variants")
    ap.add_argument("--tasks", default="passkey,needle")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 25, 50, 75, 100])
    ap.add_argument("--samples", type=int, default=4, help="prompts per task and depth")
    ap.add_argument("--prefill-chunk", type=int, default=1024, help="as LLM's default")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from served_kv_variant import served_kv_variant

    from eval.retrieval_task import WORDINGS, RetrievalTask
    from runtime.engine.engine import Engine
    from runtime.llm import LLM

    tasks = [t for t in args.tasks.split(",") if t]
    if unknown := [t for t in tasks if t not in WORDINGS]:
        raise SystemExit(f"unknown retrieval task(s) {', '.join(unknown)}; choose from {', '.join(WORDINGS)}")
    llm = LLM(args.checkpoint)
    prompts = {t: RetrievalTask(t, (args.ctx,), tuple(args.depths), args.samples).prompts(llm.tokenizer) for t in tasks}
    encoded = {t: [(p.depth, *answer_ids(llm.tokenizer, p.text, p.answer)) for p in ps] for t, ps in prompts.items()}
    longest = max(len(a) + len(b) for rows in encoded.values() for _, a, b in rows)
    if longest > llm.max_model_len:
        raise SystemExit(f"--ctx {args.ctx}: prompts and answers of up to {longest} tokens exceed the model's "
                         f"{llm.max_model_len}")
    results: dict[str, dict] = {}
    for kv in args.kv:
        start = time.time()
        with served_kv_variant(kv) as dtype:
            engine = Engine.sized_for(llm.model, longest, 1, max_num_batched_tokens=args.prefill_chunk, kv_dtype=dtype)
            per_task = {}
            for task, rows in encoded.items():
                by_depth: dict[int, list[tuple[float, bool]]] = {}
                for depth, prompt, answer in rows:
                    lp, hit = answer_logprobs(engine, prompt, answer, args.prefill_chunk)
                    by_depth.setdefault(depth, []).append((float(lp.mean()), hit))
                per_task[task] = {str(d): {"mean_logprob": sum(x for x, _ in v) / len(v),
                                           "argmax": sum(h for _, h in v), "logprobs": [x for x, _ in v]}
                                  for d, v in by_depth.items()}
        results[kv] = per_task
        line = "  ".join(f"{t} " + " ".join(f"{r['mean_logprob']:.2f}({r['argmax']})" for r in per_task[t].values())
                         for t in tasks)
        print(f"{kv:24s} {line}  ({time.time() - start:.0f}s)", flush=True)
    if args.json:
        from foundation.atomic import write_text_atomic

        write_text_atomic(args.json, json.dumps({
            "checkpoint": str(args.checkpoint), "activations": str(llm.dtype), "ctx": args.ctx, "depths": args.depths,
            "samples": args.samples, "prefill_chunk": args.prefill_chunk, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    from foundation.errors import KvslimError

    try:
        raise SystemExit(main())
    except KvslimError as e:  # a bad checkpoint or KV dtype: one line, not a traceback
        raise SystemExit(f"error: {e}") from None
