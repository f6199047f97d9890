"""`compress heal --data self`: distillation text the teacher writes itself (no download needed).

Prompts are consecutive ``prompt_len``-token windows of the calibration text (``wikipedia:calib``,
never the evaluation ranges); the teacher continues each by sampling (temperature 1, the full
distribution, as its own text) to ``seq_len`` tokens. A generator seeded once makes the
sequences the same on every run with the same seed, model and settings.
"""
from __future__ import annotations

import torch
from tqdm import tqdm

from foundation.errors import KvslimError
from foundation.texts import DEFAULT_CALIB, load_text

SELF_DATA = "self"
DEFAULT_PROMPT_TOKENS = 32
GENERATION_BATCH = 16


@torch.no_grad()
def teacher_continuations(teacher, tokenizer, num_sequences: int, seq_len: int, seed: int,
                          prompt_len: int = DEFAULT_PROMPT_TOKENS, progress: bool = True) -> list[int]:
    """``num_sequences`` sequences of exactly ``seq_len`` tokens, concatenated: a calibration prompt
    of ``prompt_len`` tokens and the teacher's sampled continuation of it."""
    if not 0 < prompt_len < seq_len:
        raise KvslimError(f"--data self: prompts of {prompt_len} tokens need --seq-len above it, got {seq_len}")
    ids = tokenizer(load_text(DEFAULT_CALIB), add_special_tokens=False)["input_ids"]
    if len(ids) < num_sequences * prompt_len:
        raise KvslimError(f"--data self: {DEFAULT_CALIB} holds {len(ids) // prompt_len} prompts, {num_sequences} needed")
    prompts = torch.tensor(ids[: num_sequences * prompt_len]).view(num_sequences, prompt_len)
    device = next(teacher.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    out = []
    for start in tqdm(range(0, num_sequences, GENERATION_BATCH), desc="teacher writes", disable=not progress):
        tokens = prompts[start:start + GENERATION_BATCH].to(device)
        cache = None
        step_input = tokens
        for _ in range(seq_len - prompt_len):
            result = teacher(input_ids=step_input, past_key_values=cache, use_cache=True)
            cache = result.past_key_values
            probs = torch.softmax(result.logits[:, -1].float(), dim=-1)
            step_input = torch.multinomial(probs, 1, generator=generator)
            tokens = torch.cat([tokens, step_input], dim=1)
        out.append(tokens.cpu())
    return torch.cat(out).flatten().tolist()
