"""kvslim's int4/int2 paged KV next to transformers' ``QuantizedCache`` (KIVI-style): served
perplexity, bytes per token and decode speed, on the same text, tokens and context in one run.

Perplexity is served on both sides (the quantized cache is written and read back), sliding windows
of ``--ctx`` tokens, stride ctx/2, fp32 weights (the default model's dequantized GGUF). What a token
reads exact differs by protocol, and moves int2 perplexity far more than the quantizers differ:

- transformers: each window is fed in forward calls of ``--first-chunk`` then ``--chunk`` tokens (64),
  one cache carried over, logits collected per call. ``QuantizedCache.update`` returns its input
  exact on its first call and quantizes all of it (no residual kept); afterwards it returns
  ``dequantized past + exact residual + the call's tokens exact``, and once residual + call reaches
  ``residual_length`` it quantizes that whole concatenation again (every earlier token re-quantized
  from its dequantized value, O(cached tokens) per flush) and empties the residual. So a call's own
  tokens are read exact, everything before it quantized (but the residual). A ``DynamicCache``
  (fp32 K/V) through the same calls is this protocol's exact baseline.
- kvslim ``window`` (as ``engine_kv_perplexity.py``): ``Engine.score``'s own pieces, one 64-token
  block per step for int4/int2: a token reads earlier blocks quantized and its own block exact.
- kvslim ``chunks``: ``Engine.score`` fed the transformers calls, each call that closes a block split
  before its last token, so a token reads its open block exact and past blocks quantized: the peer's
  protocol at ``--chunk 64`` but for the block-closing token (1 in 64), which reads its block
  quantized, and whose K/V at later layers, computed from that read, every later token reads.
  ``--chunk 1 --first-chunk 64`` makes both token-by-token decode after a 64-token prefill.

quanto's ``axis`` on a ``[batch, kv_heads, tokens, head_dim]`` state with groups of ``q_group_size``:
0 = one scale and shift per group of consecutive elements along head_dim (per token and head);
-1 = one per channel over ``q_group_size`` consecutive (head, token) rows (per channel over a block
of tokens, KIVI's keys; batch * heads * tokens must be a multiple of the group, so with 3 KV heads
every quantized length a multiple of 64). KIVI-style here: keys -1, values 0. transformers' default
(0, 0) quantizes keys per token.

Bytes per token: kvslim by the ``KVCacheSpec`` formula (packed codes, fp16 scale + minimum; no open
block at a window of whole blocks). transformers by allocation after the first full-length window:
the storage of every layer's quantized tensors (packed codes, scales, shifts, the latter in the
model's dtype, fp32 here) plus its full-precision residual, over the cached tokens.

Decode speed (``--speed``): one sequence, a ``--prompt-len`` prompt from the same text,
``--new-tokens`` greedy tokens (EOS ignored), 2 torch threads, fp32 (this CPU's fastest for both:
no native bf16), ``OMP_WAIT_POLICY`` PASSIVE unless set. Decode time runs from the first generated
token to the last (prefill excluded); a warm-up run first.

    python benchmarks/kv_quant_peer.py --text wikipedia:eval --tokens 8192 --ctx 2048 \\
        --json benchmarks/results/kv_quant_peer_wikipedia.json
    python benchmarks/kv_quant_peer.py --text pydoc:eval --tokens 8192 --ctx 2048 \\
        --json benchmarks/results/kv_quant_peer_pydoc.json
    python benchmarks/kv_quant_peer.py --tokens 2048 --ctx 512 --residual-lengths 64 128 --speed
    python benchmarks/kv_quant_peer.py --tokens 1024 --ctx 256 --chunk 1 --first-chunk 64 --kvslim-protocols chunks
"""
from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

# OpenMP threads spinning on a shared CPU make every GEMM many times slower (here 4-10x, both
# runtimes); OpenMP reads the policy once, when torch loads it. Set OMP_WAIT_POLICY=ACTIVE on idle cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from quantized_cache_peer import (  # noqa: E402
    KIVI_AXES,
    CacheBytes,
    backend_missing,
    chunked_logits,
    quantized_cache_factory,
    window_chunks,
)

CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
@dataclass
class PplRow:
    name: str
    runtime: str  # "kvslim" or "transformers"
    kv: str
    protocol: str
    residual_length: int | None = None
    perplexity: float | None = None
    bytes_per_token: float | None = None
    bytes_per_quantized_token: float | None = None  # codes and parameters only, over the quantized tokens
    bytes_counted: str = ""
    bytes_detail: dict = field(default_factory=dict)
    seconds: float | None = None
    error: str | None = None


@dataclass
class SpeedRow:
    name: str
    setting: str
    decode_tokens_per_s: float | None = None
    decode_s: float | None = None
    prefill_s: float | None = None
    total_s: float | None = None
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None


def peer_configs(args) -> tuple[list[tuple[str, str, int, int]], dict[str, str]]:
    """``(name, backend, bits, residual_length)`` for each QuantizedCache run, and skipped backends."""
    configs, skipped = [], {}
    for backend in args.backends:
        reason = backend_missing(backend)
        if reason:
            skipped[backend] = reason
            print(f"skip transformers QuantizedCache backend {backend}: {reason}", flush=True)
            continue
        for r in args.residual_lengths:
            for bits in args.peer_bits:
                configs.append((f"QuantizedCache {backend} int{bits} r{r}", backend, bits, r))
    return configs, skipped


def kvslim_bytes_per_token(model, kv: str, ctx: int) -> float:
    from runtime.cache.kv_cache import KVCacheSpec
    from runtime.cache.low_bit_kv import default_block_size

    spec = KVCacheSpec.from_layout(model.spec.attention, kv, default_block_size(kv))
    return model.spec.attention.kv_bytes_per_token(ctx, spec.element_bytes(0), spec.scale_bytes(spec.groups[0]))


def split_at_blocks(sizes: list[int], block: int) -> list[int]:
    """``sizes`` with each call that closes a kvslim block split before its last token: kvslim
    quantizes a block when its last token is written, before attention."""
    pieces, end = [], 0
    for size in sizes:
        end += size
        pieces += [size - 1, 1] if size > 1 and end % block == 0 else [size]
    return pieces


KVSLIM_PROTOCOLS = {
    "window": "Engine.score's own pieces (one block per step for int4/int2): earlier blocks read back "
              "quantized, a token's own block exact",
    "chunks": "Engine.score in the transformers calls, each split before a block's last token: past blocks "
              "read back quantized, the open block exact; the block-closing token reads its block quantized",
}


def kvslim_perplexity(args, path: Path, ids: torch.Tensor) -> list[PplRow]:
    from foundation.perplexity import perplexity
    from runtime.cache.low_bit_kv import default_block_size
    from runtime.engine.engine import Engine, EngineConfig
    from runtime.model.loader import load_model

    rows: list[PplRow] = []
    model = load_model(path, "float32")
    for protocol in args.kvslim_protocols:
        for kv in args.kv_dtypes:
            engine = Engine(model, EngineConfig(kv_dtype=kv, max_num_batched_tokens=args.ctx,
                                                max_model_len=args.ctx + 2, kv_cache_bytes=64 << 20))
            block = default_block_size(kv)
            pieces = ((lambda n: split_at_blocks(window_chunks(n, args.first_chunk, args.chunk), block))
                      if protocol == "chunks" else (lambda n: None))
            start = time.perf_counter()
            r = perplexity(lambda x: engine.score(x[0], pieces(x.shape[1]))[None], ids, args.text,
                           context=args.ctx, stride=args.ctx // 2)
            bpt = kvslim_bytes_per_token(model, kv, args.ctx)
            row = PplRow(f"kvslim {kv}, {protocol}", "kvslim", kv, KVSLIM_PROTOCOLS[protocol], perplexity=r.perplexity,
                         bytes_per_token=bpt, bytes_per_quantized_token=bpt, seconds=time.perf_counter() - start,
                         bytes_counted="KVCacheSpec formula: packed codes + fp16 scale/min; block 64 for int4/int2")
            rows.append(row)
            _print_row(row)
    return rows


def transformers_perplexity(args, path: Path, ids: torch.Tensor, configs) -> list[PplRow]:
    from transformers import DynamicCache

    from foundation.perplexity import perplexity

    rows: list[PplRow] = []
    hf = _hf_model(path)
    protocol = (f"forward calls of {args.first_chunk}, then {args.chunk} tokens, one cache per window: past read "
                "back from the cache (dequantized), a call's own tokens exact")
    runs = [("DynamicCache fp32", "fp32", None, DynamicCache)]
    runs += [(name, f"int{bits}", r, quantized_cache_factory(hf, backend, bits, r, args.q_group_size))
             for name, backend, bits, r in configs]
    for name, kv, residual, new_cache in runs:
        window_bytes: list[CacheBytes] = []
        row = PplRow(f"transformers {name}", "transformers", kv, protocol, residual_length=residual,
                     bytes_counted="allocated after a full window: codes + scales + shifts + full-precision "
                                   "residual, over cached tokens")
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                sizes = functools.partial(window_chunks, first=args.first_chunk, chunk=args.chunk)
                r = perplexity(chunked_logits(hf, new_cache, sizes, window_bytes), ids, args.text,
                               context=args.ctx, stride=args.ctx // 2)
        except (ValueError, RuntimeError) as e:
            row.error = f"{type(e).__name__}: {e}"
        else:
            full = max(window_bytes, key=lambda b: b.tokens)
            row.perplexity, row.bytes_per_token = r.perplexity, full.per_token
            row.bytes_per_quantized_token = full.per_quantized_token
            row.bytes_detail = asdict(full)
        row.seconds = time.perf_counter() - start
        rows.append(row)
        _print_row(row)
    return rows


def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _print_row(row: PplRow) -> None:
    if row.error:
        print(f"{row.name:44s} failed: {row.error}", flush=True)
    else:
        print(f"{row.name:44s} ppl {row.perplexity:.4f}  {row.bytes_per_token:8.0f} B/token  ({row.seconds:.0f} s)",
              flush=True)


class _TokenClock:
    """A ``generate`` streamer that notes when the prompt and each new token arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _speed(name: str, setting: str, times: list[float], start: float, end: float, n: int, ids: list[int]) -> SpeedRow:
    """``times``: when each generated token was ready (the first one ends prefill)."""
    decode = times[-1] - times[0]
    return SpeedRow(name, setting, (n - 1) / decode if decode > 0 else None, decode, times[0] - start, end - start, ids)


def hf_decode(model, prompt: torch.Tensor, n: int, new_cache: Callable) -> tuple[list[float], float, float, list[int]]:
    clock = _TokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(prompt[None], max_new_tokens=n, min_new_tokens=n, do_sample=False, cache=new_cache(),
                             streamer=clock, pad_token_id=model.config.eos_token_id)
    end = time.perf_counter()
    return clock.times[1:], start, end, out[0, prompt.numel():].tolist()


def kvslim_decode(model, prompt: list[int], n: int, kv: str) -> tuple[list[float], float, float, list[int]]:
    from runtime.engine.engine import Engine
    from runtime.engine.sampling import SamplingParams

    engine = Engine.sized_for(model, len(prompt) + n, 1, max_num_batched_tokens=len(prompt), kv_dtype=kv,
                              enable_prefix_caching=False)
    engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    times, tokens = [], []
    start = time.perf_counter()
    while engine.has_unfinished:
        for o in engine.step():
            if o.new_token_ids:
                times.append(time.perf_counter())
                tokens = list(o.token_ids)
    return times, start, time.perf_counter(), tokens


def measure_speed(name: str, setting: str, run: Callable, n: int, repeats: int) -> SpeedRow:
    """``run(new_tokens)`` -> (token times, start, end, token ids); a warm-up, then the fastest of
    ``repeats`` timed runs."""
    try:
        run(2)
        best = min((run(n) for _ in range(repeats)), key=lambda t: t[0][-1] - t[0][0])
        row = _speed(name, setting, *best[:3], n, best[3])
    except (ValueError, RuntimeError) as e:
        row = SpeedRow(name, setting, error=f"{type(e).__name__}: {e}")
    print(f"{name:42s} " + (f"failed: {row.error}" if row.error else
                            f"decode {row.decode_tokens_per_s:6.2f} tok/s (prefill {row.prefill_s:.2f} s)"), flush=True)
    return row


def transformers_speed(args, path: Path, prompt: torch.Tensor, configs) -> list[SpeedRow]:
    from transformers import DynamicCache

    hf = _hf_model(path)
    setting = "transformers generate, fp32 weights and KV, sdpa, greedy"
    runs = [("transformers DynamicCache fp32", DynamicCache)]
    runs += [(f"transformers {name}", quantized_cache_factory(hf, backend, bits, r, args.q_group_size))
             for name, backend, bits, r in configs]
    return [measure_speed(name, setting, lambda k, c=new_cache: hf_decode(hf, prompt, k, c), args.new_tokens, args.repeats)
            for name, new_cache in runs]


def kvslim_speed(args, path: Path, prompt: torch.Tensor) -> list[SpeedRow]:
    from runtime.model.loader import load_model

    model = load_model(path, "auto")
    setting = f"kvslim Engine, {model.activation_dtype.describe()}, greedy"
    return [measure_speed(f"kvslim {kv}", setting, lambda k, kv=kv: kvslim_decode(model, prompt.tolist(), k, kv),
                          args.new_tokens, args.repeats)
            for kv in args.kv_dtypes]


def cpu_info() -> dict:
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "flags": {f: f in flags for f in CPU_FLAGS}, "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


def versions() -> dict[str, str | None]:
    out = {}
    for pkg in ("torch", "transformers", "optimum-quanto", "hqq"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def format_table(rows: list[PplRow]) -> str:
    """Perplexity against kvslim bf16 (window) and against the exact cache of the same protocol."""
    exact = {}
    for r in rows:
        if r.kv in ("bf16", "fp32") and r.perplexity:
            exact.setdefault(r.protocol, r.perplexity)
    ref = next((r.perplexity for r in rows if r.runtime == "kvslim" and r.kv == "bf16" and r.perplexity), None)
    lines = [f"{'config':44s} {'ppl':>9s} {'vs kvslim bf16':>14s} {'vs exact, same protocol':>23s} "
             f"{'B/token':>8s} {'B/quantized token':>17s}"]
    for r in rows:
        if r.error:
            lines.append(f"{r.name:44s} failed: {r.error}")
            continue
        own = exact.get(r.protocol)
        vs_ref = f"{100 * (r.perplexity / ref - 1):+.2f}%" if ref else "-"
        vs_own = f"{100 * (r.perplexity / own - 1):+.2f}%" if own else "-"
        quantized = f"{r.bytes_per_quantized_token:.0f}" if r.bytes_per_quantized_token else "-"
        lines.append(f"{r.name:44s} {r.perplexity:9.4f} {vs_ref:>14s} {vs_own:>23s} {r.bytes_per_token:8.0f} "
                     f"{quantized:>17s}")
    for protocol in dict.fromkeys(r.protocol for r in rows):
        names = ", ".join(r.name for r in rows if r.protocol == protocol)
        lines.append(f"  {names}:\n    {protocol}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--text", default="wikipedia:eval")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--ctx", type=int, default=2048, help="scored window (stride half of it)")
    ap.add_argument("--kv-dtypes", nargs="+", default=["bf16", "int4", "int2"], help="kvslim KV dtypes")
    ap.add_argument("--backends", nargs="+", default=["quanto", "hqq"], choices=sorted(KIVI_AXES))
    ap.add_argument("--peer-bits", nargs="+", type=int, default=[4, 2])
    ap.add_argument("--residual-lengths", nargs="+", type=int, default=[64])
    ap.add_argument("--q-group-size", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=64, help="tokens per transformers forward call")
    ap.add_argument("--first-chunk", type=int, help="tokens in a window's first call (default: --chunk); "
                    "QuantizedCache quantizes it whole at once, so with 3 KV heads a multiple of 64")
    ap.add_argument("--kvslim-protocols", nargs="+", default=["window", "chunks"], choices=sorted(KVSLIM_PROTOCOLS))
    ap.add_argument("--no-perplexity", action="store_true")
    ap.add_argument("--speed", action="store_true", help="also measure decode tokens/s")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per speed row (the fastest kept)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.first_chunk = args.first_chunk or args.chunk
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (decode time runs from the first generated token)")
    torch.set_num_threads(2)

    from transformers import AutoTokenizer

    from foundation.model_source import resolve_model
    from foundation.perplexity import tokenize_range

    path = resolve_model(args.model)
    ids = tokenize_range(AutoTokenizer.from_pretrained(path), args.text, max_tokens=max(args.tokens, args.prompt_len))
    ppl_ids = ids[:args.tokens]
    configs, skipped = peer_configs(args)
    report = {
        "text": args.text, "token_range": [0, int(ppl_ids.numel())], "tokens": int(ppl_ids.numel()),
        "ctx": args.ctx, "stride": args.ctx // 2, "first_chunk": args.first_chunk, "chunk": args.chunk,
        "q_group_size": args.q_group_size,
        "residual_lengths": args.residual_lengths, "kivi_axes": {b: KIVI_AXES[b] for b in args.backends},
        "skipped_backends": skipped, "versions": versions(), "cpu": cpu_info(),
    }
    if not args.no_perplexity:
        rows = kvslim_perplexity(args, path, ppl_ids) + transformers_perplexity(args, path, ppl_ids, configs)
        print(f"\n{args.text}, first {ppl_ids.numel()} tokens, context {args.ctx}, stride {args.ctx // 2}, "
              f"fp32 weights")
        print(format_table(rows))
        report["perplexity"] = [asdict(r) for r in rows]
    if args.speed:
        prompt = ids[:args.prompt_len]
        if prompt.numel() < args.prompt_len:
            raise SystemExit(f"{args.text}: {ids.numel()} tokens, fewer than --prompt-len {args.prompt_len}")
        speed = transformers_speed(args, path, prompt, configs) + kvslim_speed(args, path, prompt)
        report["speed"] = {"prompt_tokens": args.prompt_len, "new_tokens": args.new_tokens,
                           "decode": "first generated token to last, (new_tokens - 1) tokens; prefill apart",
                           "rows": [asdict(r) for r in speed]}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
