"""The serving engine: ``step()`` = schedule -> run the decoder (prepare, forward, sample) -> postprocess.

    engine = Engine.from_checkpoint("smollm2", EngineConfig(kv_dtype="fp8_e4m3"))
    outputs = engine.generate([prompt_ids, ...], SamplingParams(max_tokens=64))  # like LLM.generate
    for out in engine.stream([prompt_ids], params):   # incremental RequestOutputs as tokens come
        ...

The scheduler decides which sequences run and how many tokens each (continuous batching,
chunked prefill, preemption); the block manager owns the block tables; the model runner
(``model_runner``) turns a ``SchedulerOutput`` into one flattened decoder call (a CUDA graph or a
compiled bucket for pure decode steps) and samples the sequences that reached their last token. ``runtime/server/engine_adapter.py`` (``ThreadedEngine``) drives it from its
own thread for the asyncio server. Stop *strings* need text, so the caller that detokenizes
checks them and calls ``abort``; stop token ids, EOS, ``max_tokens`` and ``max_model_len`` end
requests here.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from foundation.attention_layout import AttentionLayout
from foundation.checkpoint import Checkpoint
from foundation.errors import KvslimError
from foundation.kv_plan_file import planned_kv_dtype
from runtime.attention.registry import default_attention_backend, make_attention_backend
from runtime.cache.kv_cache import KVCache, KVCacheSpec
from runtime.cache.kv_quant import QUANT_DTYPES
from runtime.cache.low_bit_kv import default_block_size
from runtime.device import Placement, cuda_kv_budget
from runtime.device_choices import DEFAULT_GPU_MEMORY_UTILIZATION
from runtime.engine.block_manager import BlockManager
from runtime.engine.cuda_graphs import CudaDecodeGraphs, DecodeShape
from runtime.engine.model_runner import ModelRunner
from runtime.engine.request import Request
from runtime.engine.sampling import SamplingParams, TokenLogprob, make_generator, token_logprobs
from runtime.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from runtime.model.decode_graphs import DecodeGraphs
from runtime.model.decoder import Decoder

MODEL_KV_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
MIB = 1 << 20
DEFAULT_CPU_KV_BYTES = 512 * MIB


class KVBudgetTooSmall(KvslimError):
    """The KV pool cannot hold one sequence of ``max_model_len`` tokens; the message names the
    longest that fits the budget and the budget the length needs."""

    def __init__(self, spec: KVCacheSpec, budget_bytes: int, max_model_len: int, chunk: int):
        self.budget_bytes, self.max_model_len = budget_bytes, max_model_len
        self.longest_fitting = spec.longest_fitting(budget_bytes, chunk, max_model_len)
        self.budget_needed = spec.smallest_budget(max_model_len, chunk)
        size = f"{budget_bytes / MIB:.0f} MiB" if budget_bytes >= MIB else f"{budget_bytes >> 10} KiB"
        shorter = f"lower max_model_len to {self.longest_fitting} or " if self.longest_fitting else ""
        super().__init__(f"a KV cache of {size} cannot hold one sequence of max_model_len={max_model_len} tokens: "
                         f"{shorter}raise kv_cache_bytes to {self.budget_needed // MIB} MiB")


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs. ``kv_dtype``: fp32 | bf16 | fp16 | fp8_e4m3 | int8 | int4 | int2, or None for the model
    dtype (``from_checkpoint``: the checkpoint's ``kv_cache_scheme``, else its KV plan's). ``kv_cache_bytes`` sizes
    the block pools (None: 512 MiB on the CPU; on CUDA what ``gpu_memory_utilization`` leaves).
    ``device`` / ``kernels`` place the model ``from_checkpoint`` loads (``runtime.device``); an engine
    built over a loaded model follows that model's placement."""

    dtype: str = "auto"  # activations: auto (runtime.model.layers.activation_dtype) | float32 | bfloat16 | float16
    kv_dtype: str | None = None
    block_size: int | None = None  # tokens per block; None: 16, or 64 for int4/int2 KV (default_block_size)
    kv_cache_bytes: int | None = None
    device: str = "auto"  # auto | cpu | cuda
    kernels: str = "auto"  # auto | torch | triton
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: min(model's max_position_embeddings, 4096)
    enable_prefix_caching: bool = True
    attention_backend: str | None = None  # a name in runtime.attention.registry; None: by the model's kernels
    # CPU: decode steps padded to fixed batch sizes and compiled (runtime.model.decode_graphs). Off by default:
    # 1.2-1.8x decode speed, but ~30-35 s of compiling per batch size at start-up on 2 cores.
    compile_decode: bool = False
    enforce_eager: bool = False  # CUDA: no decode graphs (runtime.engine.cuda_graphs; vLLM's name)


@dataclass
class StepOutput:
    """A request's state after a step: generated token ids so far and, when finished, why.

    The engine's own record, in token ids; ``runtime.llm.RequestOutput`` (vLLM's shape, with
    text) is what users of ``LLM`` receive."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # one per generated token, when params.logprobs is set
    finished: bool
    finish_reason: str | None  # "stop" (EOS / stop token), "length" or "abort"
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    # Entry 0 is None (nothing predicts the first token); entry t is token t's logprob.
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    preemptions: int = 0


def kv_layer_scales(ckpt: Checkpoint, owners: Iterable[int]) -> dict[int, tuple[float, float]] | None:
    """Per-layer ``self_attn.k_scale`` / ``v_scale`` from the checkpoint, or None if absent."""
    names = {i: (f"model.layers.{i}.self_attn.k_scale", f"model.layers.{i}.self_attn.v_scale") for i in owners}
    present = [ckpt.has(k) and ckpt.has(v) for k, v in names.values()]
    if not any(present):
        return None
    if not all(present):
        raise KvslimError(f"{ckpt.path}: some cache-owning layers have KV scales and some do not")
    return {i: (float(ckpt.get(k).float().max()), float(ckpt.get(v).float().max())) for i, (k, v) in names.items()}


class Engine:
    def __init__(
        self,
        model: Decoder,
        config: EngineConfig = EngineConfig(),
        layer_scales: dict[int, tuple[float, float]] | None = None,
        kv_dtype_default: str | None = None,
    ):
        self.model = model
        self.config = config
        self.device = model.device  # the engine follows its model (runtime.device.Placement)
        spec = model.spec
        layout: AttentionLayout = spec.attention
        kv_dtype = config.kv_dtype or kv_dtype_default or MODEL_KV_DTYPES[model.dtype]
        # Checkpoint scales are calibrated for the checkpoint's own KV dtype (max/448 for FP8,
        # max/127 for INT8): another quantized dtype chosen at serve time takes per-token scales.
        static = layer_scales is not None and kv_dtype in QUANT_DTYPES and kv_dtype == (kv_dtype_default or kv_dtype)
        self.kv_dtype = kv_dtype  # a dtype name, or FULL/WINDOWED (foundation.kv_dtype_mix)
        self.block_size = config.block_size or default_block_size(kv_dtype)
        self.kv_spec = KVCacheSpec.from_layout(layout, kv_dtype, self.block_size, static_scales=static)
        self.max_model_len = config.max_model_len or min(spec.max_position_embeddings, 4096)
        budget = self._kv_budget()
        num_blocks, in_flight = self.kv_spec.pool_for(budget, self.max_model_len, config.max_num_batched_tokens)
        if any(n < need for n, need in zip(num_blocks, in_flight)):  # a lone sequence must always fit
            raise KVBudgetTooSmall(self.kv_spec, budget, self.max_model_len, config.max_num_batched_tokens)
        # Low-bit KV keeps each running sequence's open block (and, at some widths, its first block)
        # exact: residual blocks for each sequence that can run, plus Engine.score's.
        residual = (config.max_num_seqs + 1) * self.kv_spec.residual_blocks_per_seq
        self.cache = KVCache(self.kv_spec, num_blocks, self.device, layer_scales=layer_scales if static else None,
                             residual_blocks=residual, residual_dtype=model.dtype)
        placement = model.placement
        backend = config.attention_backend or default_attention_backend(placement.kernels)
        options = {"use_triton": True} if backend == "triton" and placement.triton_interpreted else {}
        attention = make_attention_backend(backend, self.cache, spec.all_attention_params(), **options)
        self.block_manager = BlockManager(num_blocks, self.block_size, self.kv_spec.windows, config.enable_prefix_caching,
                                          on_free=self.cache.release_block, sinks=self.kv_spec.sinks)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len), self.block_manager
        )
        self.runner = ModelRunner(model, attention, self.block_manager, self.block_size,
                                  DecodeGraphs(model, config.max_num_seqs) if config.compile_decode else None)
        self.runner.cuda_graphs = self._cuda_graphs(backend)
        self.eos_token_ids = frozenset(spec.eos_token_ids)
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._sent: dict[int, int] = {}  # tokens already reported per request
        self._generators: dict[int, torch.Generator | None] = {}
        self._prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}

    def _cuda_graphs(self, backend: str) -> CudaDecodeGraphs | None:
        """Decode replayed from CUDA graphs: on by default on CUDA with the Triton kernels, unless
        ``enforce_eager``."""
        if self.device.type != "cuda" or self.config.enforce_eager or backend != "triton":
            return None
        shape = DecodeShape(self.config.max_num_seqs, self.block_size, self.max_model_len, len(self.kv_spec.groups))
        return CudaDecodeGraphs(self.model, self.runner.backend, shape)

    # The runner's parts, as the engine's: tests and benchmarks swap or inspect them.
    @property
    def backend(self):
        return self.runner.backend

    @backend.setter
    def backend(self, value) -> None:
        self.runner.backend = value

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self.runner.graphs

    @property
    def cuda_graphs(self) -> CudaDecodeGraphs | None:
        return self.runner.cuda_graphs

    @cuda_graphs.setter
    def cuda_graphs(self, value: CudaDecodeGraphs | None) -> None:
        self.runner.cuda_graphs = value

    def _kv_budget(self) -> int:
        """Bytes for the block pools: the configured figure, else by device."""
        if self.config.kv_cache_bytes is not None:
            return self.config.kv_cache_bytes
        if self.device.type == "cuda":
            return cuda_kv_budget(self.device, self.config.gpu_memory_utilization)
        return DEFAULT_CPU_KV_BYTES

    @classmethod
    def sized_for(cls, model: Decoder, longest: int, num_seqs: int, **config) -> "Engine":
        """An engine whose paged cache holds ``num_seqs`` sequences of ``longest`` tokens, plus one
        spare; ``config``: further ``EngineConfig`` fields (KV dtype: the model's unless given)."""
        kv_dtype = config.get("kv_dtype") or MODEL_KV_DTYPES[model.dtype]
        kv_spec = KVCacheSpec.from_layout(model.spec.attention, kv_dtype, config.get("block_size") or default_block_size(kv_dtype))
        chunk = config.get("max_num_batched_tokens", EngineConfig.max_num_batched_tokens)
        groups = range(len(kv_spec.groups))
        per_seq = [kv_spec.max_blocks_per_seq(g, longest) for g in groups]
        seq_bytes = sum(n * kv_spec.block_bytes(g) + kv_spec.exact_block_bytes(g) for g, n in zip(groups, per_seq))
        # plan_num_blocks splits a budget by per_seq; each group needs its blocks in flight per sequence.
        seqs = max(num_seqs * kv_spec.blocks_in_flight(g, longest, chunk) / per_seq[g] for g in groups)
        budget = math.ceil(seqs * seq_bytes) + seq_bytes
        return cls(model, EngineConfig(kv_cache_bytes=budget, max_model_len=longest, **config))

    @classmethod
    def from_checkpoint(cls, model: str | Path | Checkpoint, config: EngineConfig = EngineConfig()) -> "Engine":
        """Load ``model`` (a name ``resolve_model`` knows, a checkpoint dir, or one already opened)
        and build an engine."""
        from foundation.model_source import resolve_model
        from runtime.model.loader import load_model

        ckpt = model if isinstance(model, Checkpoint) else Checkpoint.open(resolve_model(str(model)))
        decoder = load_model(ckpt, config.dtype, placement=Placement.resolve(config.device, config.kernels))
        spec = decoder.spec
        scales = kv_layer_scales(ckpt, spec.attention.cache_owners())
        # the checkpoint's own KV choice: its kv_cache_scheme, else the KV plan's dtype (plan.json)
        default = spec.quant.kv_dtype if spec.quant and spec.quant.kv_dtype else planned_kv_dtype(ckpt.path)
        return cls(decoder, config, scales, default)

    # --- requests ------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        params = params or SamplingParams()
        rid = next(self._ids)
        stop = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop |= self.eos_token_ids
        ids = [int(t) for t in prompt_token_ids]
        vocab = self.model.spec.vocab_size
        if not all(0 <= t < vocab for t in ids):
            raise KvslimError(f"token ids must be in [0, {vocab})")
        # Prompt logprobs need every prompt position computed, so such requests skip the prefix cache.
        seq = Request(rid, ids, params.max_tokens, frozenset(stop), params,
                      use_prefix_cache=params.prompt_logprobs is None)
        self.scheduler.add(seq)
        self._sent[rid] = 0
        self._generators[rid] = make_generator(params, self.device)
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[rid] = [None]
        return rid

    def abort(self, request_id: int) -> StepOutput | None:
        seq = self.scheduler.abort(request_id)
        return self._output(seq) if seq is not None else None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # --- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Schedule, run one decoder call and sample (``ModelRunner``), postprocess. Returns outputs
        of the requests that produced a token (or finished) this step."""
        out = self.scheduler.schedule()
        self.stats.preemptions += len(out.preempted)
        if not out.scheduled:
            if out.preempted:
                return []
            if self.scheduler.has_unfinished:
                raise KvslimError("no request fits in the KV cache (raise kv_cache_bytes or lower max_model_len)")
            return []
        sampled = self._run(out)
        self.scheduler.postprocess(out, sampled)  # frees finished requests' blocks
        self.stats.steps += 1
        return [self._output(s.seq) for s in out.scheduled if s.samples]

    def _run(self, out: SchedulerOutput) -> dict[int, int]:
        """Run the decoder on the step's tokens (``ModelRunner``), score prompt tokens where asked,
        then sample the sequences that reached their last token."""
        sched = out.scheduled
        starts = [0]
        for s in sched:
            starts.append(starts[-1] + s.num_new_tokens)
            if s.first_position < s.seq.num_prompt_tokens:
                self.stats.prompt_tokens_computed += min(s.num_new_tokens, s.seq.num_prompt_tokens - s.first_position)
        hidden = self.runner.forward(sched, graphed=not any(s.seq.seq_id in self._prompt_logprobs for s in sched))
        for i, s in enumerate(sched):
            if s.seq.seq_id in self._prompt_logprobs:
                self._score_prompt(s.seq, s.first_position, hidden[starts[i]:starts[i + 1]])
        rows = [i for i, s in enumerate(sched) if s.samples]
        if not rows:
            return {}
        last = hidden if len(rows) == hidden.shape[0] else hidden[[starts[i + 1] - 1 for i in rows]]
        seqs = [sched[i].seq for i in rows]
        tokens, logprobs = self.runner.sample(last, seqs, [self._generators[q.seq_id] for q in seqs])
        sampled = {}
        for seq, tok, lp in zip(seqs, tokens, logprobs):
            sampled[seq.seq_id] = tok
            if lp is not None:
                seq.output_logprobs.append(lp)
        self.stats.generated_tokens += len(seqs)
        return sampled

    def _score_prompt(self, seq: Request, first: int, hidden: torch.Tensor) -> None:
        """Append the logprobs of the prompt tokens this chunk's rows predict (once each)."""
        lps = self._prompt_logprobs[seq.seq_id]
        lo = len(lps) - 1 - first  # first row whose target has no logprob yet (recompute skips)
        hi = min(hidden.shape[0], seq.num_prompt_tokens - 1 - first)
        if hi > lo:
            targets = torch.tensor(seq.prompt_token_ids[first + lo + 1:first + hi + 1], dtype=torch.long,
                                   device=self.device)
            lps.extend(token_logprobs(self.model.compute_logits(hidden[lo:hi]), targets, seq.sampling.prompt_logprobs))

    def _output(self, seq: Request) -> StepOutput:
        sent = self._sent.get(seq.seq_id, 0)
        self._sent[seq.seq_id] = len(seq.output_token_ids)
        prompt_lps = self._prompt_logprobs.get(seq.seq_id)
        if seq.is_finished:
            for d in (self._sent, self._generators, self._prompt_logprobs):
                d.pop(seq.seq_id, None)
        return StepOutput(
            request_id=seq.seq_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            new_token_ids=seq.output_token_ids[sent:],
            logprobs=list(seq.output_logprobs) if seq.sampling.logprobs is not None else None,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens,
            prompt_logprobs=list(prompt_lps) if prompt_lps is not None else None,
        )

    @torch.inference_mode()
    def score(self, token_ids: Sequence[int], pieces: Sequence[int] | None = None) -> torch.Tensor:
        """fp32 logits ``[T, vocab]`` of every position of one sequence, computed through the
        paged cache (so quantized KV is read back as served), fed in ``pieces`` (token counts
        that sum to T; default: chunks of ``max_num_batched_tokens``, or of one block with int4/int2
        KV, so that every token reads what it would when decoded: earlier blocks quantized, its own
        block exact; decoding, a block's last token reads its block-mates quantized; FP8/INT8: each
        token its own row exact and every other as stored: ``PagedBatch.exact_new_rows``). Call between
        steps; the sequence's blocks are freed before returning."""
        out: torch.Tensor | None = None  # filled piece by piece: [T, vocab] is the big tensor here
        for start, logits in self.score_pieces(token_ids, pieces):
            if out is None:
                out = logits.new_empty((len(token_ids), logits.shape[-1]))
            out[start:start + logits.shape[0]] = logits
        return out

    def score_targets(self, token_ids: Sequence[int], pieces: Sequence[int] | None = None) -> torch.Tensor:
        """fp32 ``[T - 1]``: the log-probability of token t + 1 at position t, as ``score`` computes
        it, without its ``[T, vocab]`` tensor (34 GB at 32,768 positions of a 262k vocabulary)."""
        from foundation.perplexity import target_logprobs

        ids = torch.as_tensor([int(t) for t in token_ids], dtype=torch.long)
        out = torch.empty(max(0, len(ids) - 1), dtype=torch.float32)
        for start, logits in self.score_pieces(token_ids, pieces):
            end = min(start + logits.shape[0], len(ids) - 1)  # the last position predicts nothing
            if end > start:
                out[start:end] = target_logprobs(logits[:end - start], ids[start + 1:end + 1].to(logits.device)).cpu()
        return out

    def score_pieces(self, token_ids: Sequence[int], pieces: Sequence[int] | None = None, logits_from: int = 0,
                     exact_new_rows: bool = False):
        """Yield ``(first, fp32 logits [n, vocab])`` of each piece of ``score``'s walk through the
        cache (``score``'s ``pieces``), one piece's logits alive at a time: rows from position
        ``first``, none before ``logits_from`` (a piece wholly before it yields none).
        ``exact_new_rows``: each piece read as a served prefill chunk (``ModelRunner.score_piece``)."""
        ids = [int(t) for t in token_ids]
        if not 0 < len(ids) <= self.max_model_len:
            raise KvslimError(f"score needs 1..{self.max_model_len} tokens, got {len(ids)}")
        chunk = self.block_size if any(g.bits for g in self.kv_spec.groups) else self.config.max_num_batched_tokens
        sizes = list(pieces) if pieces is not None else [min(chunk, len(ids) - a) for a in range(0, len(ids), chunk)]
        if sum(sizes) != len(ids) or min(sizes) < 1:
            raise KvslimError(f"score: pieces {sizes} must be positive and sum to the {len(ids)} tokens")
        sid = -1 - next(self._ids)  # never collides with request ids
        bm = self.block_manager
        if not bm.allocate(sid, bm.no_hit(), sizes[0]):
            raise KvslimError("score: no free KV blocks (the engine is busy)")
        try:
            start = 0
            for n in sizes:
                bm.release_window(sid, start)
                if not bm.append(sid, start, start + n):
                    raise KvslimError("score: no free KV blocks (the engine is busy)")
                skip = min(n, max(0, logits_from - start))
                logits = self.runner.score_piece(ids[start:start + n], start, bm.block_tables(sid), exact_new_rows, skip)
                if skip < n:
                    yield start + skip, logits
                start += n
        finally:
            bm.free(sid)

    # --- offline API ---------------------------------------------------------------------------
    def stream(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> Iterator[StepOutput]:
        """Add ``prompts`` and step until they finish, yielding each request's output whenever
        it gains a token. Requests already in the engine keep running alongside."""
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise KvslimError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        mine = {self.add_request(p, sp) for p, sp in zip(prompts, plist)}
        done: set[int] = set()
        try:
            while done != mine and self.has_unfinished:
                for o in self.step():
                    if o.request_id in mine:
                        if o.finished:
                            done.add(o.request_id)
                        yield o
        finally:
            for rid in mine - done:  # the caller stopped early: free their blocks
                self.abort(rid)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[StepOutput]:
        """Final outputs, in prompt order (``LLM.generate`` semantics)."""
        final = {o.request_id: o for o in self.stream(prompts, params) if o.finished}
        return [final[r] for r in sorted(final)]  # request ids grow in prompt order
