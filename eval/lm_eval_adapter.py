"""lm-eval's ``LM`` over kvslim's serving engine, registered as ``kvslim``.

    from eval.lm_eval_adapter import register
    register()   # imports lm_eval.models first, so lm-eval's own names (hf, ...) stay resolvable
    lm_eval.simple_evaluate(model="kvslim", model_args="pretrained=out/ckpt,kv_cache_dtype=fp8", ...)

Scores are computed the way lm-eval's ``hf`` model computes them (same tokenization through
``TemplateLM``, same truncation to ``max_length + 1`` tokens, same rolling windows), but every
forward pass runs through the paged KV cache of :class:`runtime.engine.engine.Engine`, so quantized
weights and a quantized KV cache are measured as served. Requests are batched by the engine's
scheduler (continuous batching); each asks for its prompt logprobs with the top-1 alternative,
which gives both the continuation's logprob and whether it was the greedy choice.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import (
    _add_special_kwargs,
    handle_stop_sequences,
    has_bos_prefix,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from foundation.errors import KvslimError
from runtime.cache.kv_dtype_choices import KV_CACHE_DTYPES as CLI_KV_CACHE_DTYPES
from runtime.cache.kv_dtype_choices import cache_kv_dtype

MODEL_NAME = "kvslim"
# model_args spelling -> the engine's KV dtype name
KV_CACHE_DTYPES = {**CLI_KV_CACHE_DTYPES, "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "fp8_e4m3": "fp8_e4m3"}
DEFAULT_MAX_GEN_TOKS = 256
MIB = 1 << 20


class KvslimLM(TemplateLM):
    """``pretrained``: checkpoint dir or model name; ``dtype``: activations (auto / float32 / bfloat16);
    ``kv_cache_dtype``: auto (the checkpoint's kv_cache_scheme, else its KV plan's, else the model dtype) | fp32 | bf16
    | fp16 | fp8 | int8 | int4 | k4v2 | k3v2 | int2; ``max_length``: longest scored window (default: the model's
    max_position_embeddings, capped at 4096 as the engine's max_model_len, raised to ``min_length`` (a
    perplexity context the caller will score) up to the model's positions); ``batch_size``: requests
    the engine runs concurrently; ``kv_cache_mib``: the KV pool (default: 512 MiB on the CPU, by free
    memory on CUDA); ``device`` (lm-eval's own argument: auto / cpu / cuda / cuda:N, where N must be 0)
    and ``kernels``: ``runtime.device.Placement``."""

    def __init__(
        self,
        pretrained: str | Path = "smollm2",
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        max_length: int | None = None,
        min_length: int = 0,
        batch_size: int | str = 8,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        kv_cache_mib: int | None = None,
        add_bos_token: bool | None = None,
        device: str | None = None,
        kernels: str = "auto",
        **unused: Any,  # lm-eval passes max_batch_size
    ) -> None:
        super().__init__()
        from transformers import AutoTokenizer

        from foundation.model_source import resolve_model
        from runtime.engine.engine import Engine, EngineConfig

        try:  # one name, or FULL/WINDOWED
            kv_dtype = cache_kv_dtype(str(kv_cache_dtype).lower(), KV_CACHE_DTYPES)
        except KvslimError as e:
            raise KvslimError(f"kv_cache_dtype={kv_cache_dtype!r}: {e}") from None
        path = resolve_model(str(pretrained))
        positions = int(json.loads((path / "config.json").read_text()).get("max_position_embeddings", 2048))
        max_len = int(max_length) if max_length is not None else min(max(min(positions, 4096), int(min_length)),
                                                                       positions)
        num_seqs = 8 if str(batch_size).startswith("auto") else max(1, int(batch_size))
        # A scored sequence of max_length + 1 tokens runs whole as a prompt (its last token is only
        # a target) and samples one token: the engine needs two positions of room.
        device = str(device or "auto")
        if device.startswith("cuda:"):
            if device != "cuda:0":
                raise KvslimError(f"device={device}: the kvslim engine runs on one GPU, cuda:0")
            device = "cuda"
        self.engine = Engine.from_checkpoint(path, EngineConfig(
            dtype=str(dtype), kv_dtype=kv_dtype,
            kv_cache_bytes=None if kv_cache_mib is None else int(kv_cache_mib) * MIB,
            max_num_seqs=num_seqs, max_model_len=max_len + 2, device=device, kernels=str(kernels),
        ))
        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.add_bos_token = add_bos_token
        self._max_length = max_len
        self.max_gen_toks = int(max_gen_toks)
        self.batch_size = num_seqs

    # --- what TemplateLM needs ----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        return self.tokenizer.encode(string, **special)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # --- scoring ------------------------------------------------------------------------------
    def _score_pairs(self, pairs: list[tuple[list[int], list[int]]], desc: str,
                     disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(logprob of the continuation, greedy?) per (context, continuation) token pair, truncated
        as lm-eval's ``hf`` model does: to the last ``max_length + 1`` tokens."""
        from runtime.engine.sampling import SamplingParams

        # The whole sequence is the prompt: its prompt logprobs cover every continuation token.
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, ignore_eos=True)
        seqs = [(ctx + cont)[-(self.max_length + 1):] for ctx, cont in pairs]
        if any(not cont for _, cont in pairs) or any(len(s) < 2 for s in seqs):
            raise KvslimError("lm-eval request with an empty context or continuation")
        results: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -len(seqs[i]))  # longest first, as hf
        per_call = 4 * self.batch_size  # the engine runs batch_size at a time; a few more queued
        with tqdm(total=len(pairs), desc=desc, disable=disable_tqdm) as bar:
            for lo in range(0, len(order), per_call):
                idx = order[lo:lo + per_call]
                for i, out in zip(idx, self.engine.generate([seqs[i] for i in idx], params)):
                    n = min(len(pairs[i][1]), len(seqs[i]) - 1)
                    lps = out.prompt_logprobs[-n:]
                    results[i] = (sum(lp.logprob for lp in lps), all(lp.top[0][0] == lp.token_id for lp in lps))
                bar.update(len(idx))
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        out = self._score_pairs([(ctx, cont) for _, ctx, cont in requests], "kvslim loglikelihood", disable_tqdm)
        for (key, _, _), r in zip(requests, out):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, r)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for w in map(make_disjoint_window, get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1,
            )):
                windows.append(w)
                owner.append(i)
        scores = self._score_pairs(windows, "kvslim loglikelihood_rolling", disable_tqdm)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, scores):
            totals[i] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --- generation ---------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, per the task's ``do_sample``/``temperature``) continuations, cut at
        the task's stop strings and EOS as lm-eval's ``hf`` model cuts them."""
        from runtime.engine.sampling import SamplingParams

        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        prompts, params, stops = [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) else 0.0
            ids = self.tok_encode(context)[-(self.max_length - max_gen):]
            prompts.append(ids)
            params.append(SamplingParams(temperature=temperature, max_tokens=max_gen, seed=1234))
            stops.append(until)
        outs = []
        with tqdm(total=len(prompts), desc="kvslim generate_until", disable=disable_tqdm) as bar:
            for lo in range(0, len(prompts), 4 * self.batch_size):
                outs.extend(self.engine.generate(prompts[lo:lo + 4 * self.batch_size], params[lo:lo + 4 * self.batch_size]))
                bar.update(min(4 * self.batch_size, len(prompts) - lo))
        texts = []
        for req, out, until in zip(requests, outs, stops):
            text = postprocess_generated_text(generation=self.tok_decode(out.token_ids), stop=until, think_end_token=None)
            self.cache_hook.add_partial("generate_until", req.args, text)
            texts.append(text)
        return texts

    # --- perplexity entries ----------------------------------------------------------------------
    def logits_fn(self, ids: torch.Tensor) -> torch.Tensor:
        """``foundation.perplexity.LogitsFn``: logits ``[1, T, vocab]`` through the paged cache."""
        return self.engine.score(ids.flatten().tolist()).unsqueeze(0)

    def logprobs_fn(self, ids: torch.Tensor) -> torch.Tensor:
        """``foundation.perplexity.TargetLogprobsFn``: each next token's log-probability ``[T - 1]``
        through the paged cache, without a ``[T, vocab]`` logits tensor."""
        return self.engine.score_targets(ids.flatten().tolist())


def register() -> type[KvslimLM]:
    """Register :class:`KvslimLM` as lm-eval model ``kvslim`` (idempotent).

    lm-eval's built-in models register lazily when ``lm_eval.models`` is imported; registering ours
    first would leave the registry without them, so that import comes first."""
    import lm_eval.models  # noqa: F401  (the built-in models: hf, vllm, ...)
    from lm_eval.api.registry import get_model, model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME)(KvslimLM)
    assert get_model(MODEL_NAME) is KvslimLM
    return KvslimLM
