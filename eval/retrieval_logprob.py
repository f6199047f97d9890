"""Retrieval as a continuous figure, served: a retrieval prompt's answer log-probability.

A hit rate at a few prompts a depth moves in large steps and flips on a near-tie; the
log-probability of the answer's tokens does not. The prompt runs through a kvslim engine with the
KV cache really compressed, as ``LLM`` serves one request: prefilled in chunks (each chunk's new
rows read exact), then the answer (``" " + key``) fed one token at a time as decoded.
"""
from __future__ import annotations

import torch

from foundation.errors import KvslimError


def answer_ids(tokenizer, text: str, answer: str) -> tuple[list[int], list[int]]:
    """``(prompt ids, answer ids)``: ``text`` as the runtime tokenizes a prompt, and the tokens that
    ``" " + answer`` adds after it (one-line error where the joint tokenization does not extend it)."""
    prompt = list(tokenizer(text)["input_ids"])
    full = list(tokenizer(text + " " + answer)["input_ids"])
    if full[:len(prompt)] != prompt or len(full) == len(prompt):
        raise KvslimError(f"the answer {answer!r} does not tokenize as a continuation of its prompt")
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


def served_answers(engine, encoded: list[tuple[list[int], list[int]]], prefill_chunk: int) -> list[tuple[float, bool]]:
    """For each ``(prompt ids, answer ids)``, served one after another on ``engine``: the mean
    log-probability of its answer's tokens and whether greedy decoding answers it."""
    out = []
    for prompt, answer in encoded:
        lp, hit = answer_logprobs(engine, prompt, answer, prefill_chunk)
        out.append((float(lp.mean()), hit))
    return out
