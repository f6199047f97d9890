"""``LLM``: load a checkpoint, generate text, score token sequences (the runtime core's front door).

    llm = LLM("path/to/checkpoint", dtype="bfloat16")
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    logits = llm.score(token_ids)               # fp32 [T, vocab], position t predicts token t + 1

``generate`` and ``stream`` run on the serving engine (``runtime/engine/engine.py``: paged cache,
continuous batching, chunked prefill of ``prefill_chunk`` tokens, at most ``max_num_seqs`` running),
one engine per call sized for its requests; stop strings are matched by the ``Detokenizer`` as
tokens come and abort the request. ``score`` runs through the engine's paged cache too.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from foundation.errors import KvslimError
from foundation.kv_plan_file import planned_kv_dtype
from foundation.model_source import resolve_model
from runtime.cache.kv_cache import KVCacheSpec
from runtime.device import Placement
from runtime.engine.detokenizer import Detokenizer
from runtime.engine.engine import (
    MODEL_KV_DTYPES,
    Engine,
    StepOutput,
    default_block_size,
)
from runtime.engine.sampling import SamplingParams, TokenLogprob
from runtime.model.loader import live_weight_bytes, load_model

PromptInput = str | Sequence[int]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass(frozen=True)
class CompletionOutput:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    cumulative_logprob: float | None  # sum of the chosen tokens' logprobs (when logprobs asked)
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class RequestOutput:
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    # Entry 0 is None (nothing predicts the first token); entry t is token t's logprob.
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass
class _Request:
    index: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    out_ids: list[int]
    out_logprobs: list[TokenLogprob]
    cumulative: float = 0.0
    detokenizer: Detokenizer | None = None  # with stop strings: matches them as tokens come
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    """A checkpoint loaded for generation and scoring.

    ``checkpoint``: a directory, ``.gguf`` file or known model name (default: the default model).
    ``dtype``: ``auto`` (default: by the CPU's features, ``runtime.model.layers.activation_dtype``) or
    ``float32`` / ``bfloat16`` / ``float16`` activations (quantized weights stay packed).
    ``max_model_len``: longest sequence (prompt + output), at most the config's
    ``max_position_embeddings``. ``kv_cache_dtype``: the paged cache's KV dtype (``fp8_e4m3``,
    ``int8``, ``int4``, ``int2``, ...; default: the checkpoint's KV plan's, else the activation dtype).
    """

    def __init__(
        self,
        checkpoint: str | Path | None = None,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 32,
        prefill_chunk: int = 1024,
        use_cpu_kernels: bool = True,
        kv_cache_dtype: str | None = None,
        device: str = "auto",
        kernels: str = "auto",
        enforce_eager: bool = False,
    ) -> None:
        """``device`` (auto | cpu | cuda) and ``kernels`` (auto | torch | triton): where the model and
        its cache live and which kernels run (``runtime.device.Placement``); ``enforce_eager``: no
        CUDA graphs for decode (``runtime.engine.cuda_graphs``)."""
        self.enforce_eager = enforce_eager
        self.path = resolve_model(checkpoint)
        self.model = load_model(self.path, dtype, use_cpu_kernels=use_cpu_kernels,
                                placement=Placement.resolve(device, kernels))
        self.activation_dtype = self.model.activation_dtype
        self.dtype = self.activation_dtype.dtype
        self.spec = self.model.spec
        limit = self.spec.max_position_embeddings
        if max_model_len is not None and not 1 <= max_model_len <= limit:
            raise KvslimError(f"max_model_len={max_model_len} must be in [1, {limit}] (the model's max_position_embeddings)")
        self.max_model_len = max_model_len or limit
        if max_num_seqs < 1 or prefill_chunk < 1:
            raise KvslimError("max_num_seqs and prefill_chunk must be >= 1")
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk = prefill_chunk
        self.tokenizer = self._load_tokenizer()
        self.kv_cache_dtype = kv_cache_dtype or planned_kv_dtype(self.path) or MODEL_KV_DTYPES[self.dtype]
        block = default_block_size(self.kv_cache_dtype)
        self.kv_spec = KVCacheSpec.from_layout(self.spec.attention, self.kv_cache_dtype, block)  # refuses a bad name
        self._engine_kept: Engine | None = None
        self._engine_size: tuple[int, int] | None = None  # (longest sequence, sequences) its cache holds

    # --- setup -------------------------------------------------------------------------------
    def _load_tokenizer(self):
        if not any((self.path / f).is_file() for f in TOKENIZER_FILES):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path), trust_remote_code=False)

    # --- facts -------------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        """Resident bytes of the model's weights, measured from the live tensors."""
        return live_weight_bytes(self.model)

    def kv_bytes_per_token(self, context_len: int | None = None) -> float:
        """KV bytes per token at ``context_len`` (default: max_model_len) in this runtime's cache
        dtype(s), scales included, by ``KVCacheSpec.kv_bytes_per_token``."""
        return self.kv_spec.kv_bytes_per_token(self.spec.attention, context_len or self.max_model_len)

    # --- inputs ------------------------------------------------------------------------------
    def _tokenize(self, prompt: PromptInput, i: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise KvslimError(f"prompt {i} is empty")
            if self.tokenizer is None:
                raise KvslimError(f"{self.path} has no tokenizer; pass token ids instead of text")
            ids = self.tokenizer(prompt)["input_ids"]
            return prompt, list(ids)
        ids = list(prompt)
        if not ids:
            raise KvslimError(f"prompt {i} is empty")
        if not all(isinstance(t, int) and 0 <= t < self.spec.vocab_size for t in ids):
            raise KvslimError(f"prompt {i}: token ids must be integers in [0, {self.spec.vocab_size})")
        return None, ids

    def _check_length(self, ids: list[int], i: int) -> None:
        if len(ids) > self.max_model_len:
            raise KvslimError(f"prompt {i} has {len(ids)} tokens, longer than the context of {self.max_model_len}")

    @staticmethod
    def _as_list(prompts) -> list[PromptInput]:
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]  # one tokenized prompt
        return prompts

    # --- forward passes ----------------------------------------------------------------------
    @torch.inference_mode()
    def score(self, token_ids: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor | list[torch.Tensor]:
        """fp32 logits ``[T, vocab]`` for every position of a token sequence (row t predicts
        token t + 1), through the engine's paged cache in chunks of ``prefill_chunk``. A list of
        sequences returns a list."""
        single = isinstance(token_ids, str) or bool(token_ids) and all(isinstance(t, int) for t in token_ids)
        seqs = [self._tokenize(s, i)[1] for i, s in enumerate(self._as_list(token_ids))]
        for i, ids in enumerate(seqs):
            self._check_length(ids, i)
        engine = Engine.sized_for(self.model, max(map(len, seqs)), 1, max_num_batched_tokens=self.prefill_chunk,
                                  kv_dtype=self.kv_cache_dtype)
        results = [engine.score(ids) for ids in seqs]
        return results[0] if single else results

    # --- generation --------------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Continue each prompt (text, or a list of token ids); one ``RequestOutput`` per prompt,
        in order."""
        requests = self._requests(prompts, sampling_params)
        for _ in self._run(requests):
            pass
        return [self._output(r) for r in requests]

    def stream(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Yield ``(prompt index, RequestOutput so far)`` whenever a request gains tokens or
        finishes (its ``finish_reason`` is None until then). Stopping early aborts the rest."""
        requests = self._requests(prompts, sampling_params)
        for r in self._run(requests):
            yield r.index, self._output(r)

    def _requests(self, prompts, sampling_params) -> list[_Request]:
        prompts = self._as_list(prompts)
        if not prompts:
            raise KvslimError("no prompts given")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise KvslimError(f"{len(params)} sampling params for {len(prompts)} prompts")
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not isinstance(p, SamplingParams):
                raise KvslimError(f"sampling params {i} is a {type(p).__name__}, not SamplingParams")
            if p.stop and self.tokenizer is None:
                raise KvslimError("stop strings need a tokenizer; this checkpoint has none")
            text, ids = self._tokenize(prompt, i)
            self._check_length(ids, i)
            detokenizer = Detokenizer.for_params(self.tokenizer, p) if p.stop else None
            requests.append(_Request(i, text, ids, p, [], [], detokenizer=detokenizer))
        return requests

    def _engine(self, requests: list[_Request]) -> Engine:
        """The engine over this model, kept across calls (its prefix cache, and on a GPU its captured
        decode graphs, with it). Its paged cache holds every running sequence at its longest, plus
        one; a call that needs more replaces it with one sized for that (never smaller)."""
        longest = min(max(len(r.prompt_ids) + r.params.max_tokens for r in requests), self.max_model_len)
        seqs = min(len(requests), self.max_num_seqs)
        if self._engine_size is not None:
            held_longest, held_seqs = self._engine_size
            if held_longest >= longest and held_seqs >= seqs:
                return self._engine_kept
            longest, seqs = max(longest, held_longest), max(seqs, held_seqs)
            self._engine_kept = None  # its cache is freed before the larger one is allocated
        self._engine_kept = Engine.sized_for(self.model, longest, seqs, max_num_seqs=self.max_num_seqs,
                                             max_num_batched_tokens=self.prefill_chunk, enable_prefix_caching=True,
                                             kv_dtype=self.kv_cache_dtype, enforce_eager=self.enforce_eager)
        self._engine_size = (longest, seqs)
        return self._engine_kept

    def _run(self, requests: list[_Request]) -> Iterator[_Request]:
        """Run ``requests`` on the kept engine; yield each request whenever it changes."""
        engine = self._engine(requests)
        by_id = {engine.add_request(r.prompt_ids, r.params): r for r in requests}
        try:
            while engine.has_unfinished:
                for o in engine.step():
                    r = by_id.get(o.request_id)
                    if r is None or r.finish_reason is not None:
                        continue
                    self._update(r, o)
                    if r.finish_reason is not None and not o.finished:
                        engine.abort(o.request_id)  # a stop string ended it
                    yield r
        finally:
            for rid, r in by_id.items():
                if r.finish_reason is None:
                    engine.abort(rid)

    def _update(self, r: _Request, o: StepOutput) -> None:
        r.out_ids = list(o.token_ids)
        if o.logprobs is not None:
            r.out_logprobs = list(o.logprobs)
            r.cumulative = sum(lp.logprob for lp in r.out_logprobs)
        if o.prompt_logprobs is not None:
            r.prompt_logprobs = list(o.prompt_logprobs)
        if r.detokenizer is not None and o.new_token_ids:
            r.detokenizer.update(r.out_ids, o.finished)
            if r.detokenizer.stopped:
                r.finish_reason = "stop"
                return
        if o.finished:
            r.finish_reason = o.finish_reason

    def _output(self, r: _Request) -> RequestOutput:
        if r.detokenizer is not None and r.detokenizer.stopped:
            text = r.detokenizer.text
        else:
            text = Detokenizer(self.tokenizer).decode(r.out_ids) if self.tokenizer is not None else ""
        completion = CompletionOutput(
            text=text,
            token_ids=tuple(r.out_ids),
            finish_reason=r.finish_reason or "length",
            cumulative_logprob=r.cumulative if r.params.logprobs is not None else None,
            logprobs=tuple(r.out_logprobs) if r.params.logprobs is not None else None,
        )
        return RequestOutput(
            prompt=r.prompt,
            prompt_token_ids=tuple(r.prompt_ids),
            outputs=(completion,),
            prompt_logprobs=tuple(r.prompt_logprobs) if r.prompt_logprobs is not None else None,
        )
