"""The engine on a GPU against HF transformers on the same GPU: greedy tokens agree, then aggregate
decode throughput at 1 / 8 / 32 / 128 concurrent requests (``make bench-gpu``).

Prompts: consecutive 128-token slices of ``wikipedia:eval``; each request generates exactly 128
tokens (EOS ignored), greedy. Throughput = generated tokens / wall time from submit to the last
token (prefill included), all requests together, after one warm-up run. The engine runs with
``--device`` / ``--kernels`` (default cuda + triton: the Triton dequant-matmul, KV-store and
paged-attention kernels) on each checkpoint given (the default model in bf16, plus e.g. a W4A16
or FP8 one); HF transformers runs bf16 ``generate`` on padded batches (its fastest setting on a
GPU without compilation). Greedy agreement: the first ``--agree-tokens`` tokens of 4 prompts,
compared until the first position where HF's top two logits are within 1e-2 (a near-tie bf16
may flip).

    python benchmarks/gpu_engine.py --json benchmarks/results/gpu_engine.json
    python benchmarks/gpu_engine.py --device cpu --kernels torch --concurrency 1 2 --new-tokens 4   # smoke

Without CUDA (and no ``--device cpu``) it prints one line and exits 2.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a script

PROMPT_TOKENS = 128
NEAR_TIE = 1e-2


def real_prompts(model_dir: Path, n: int, length: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from foundation.perplexity import tokenize_range

    ids = tokenize_range(AutoTokenizer.from_pretrained(model_dir), "wikipedia:eval", max_tokens=n * length).tolist()
    return [ids[i * length:(i + 1) * length] for i in range(n)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_for(model_dir: Path, device: str, kernels: str, max_seqs: int):
    from runtime.engine.engine import Engine, EngineConfig

    return Engine.from_checkpoint(model_dir, EngineConfig(
        device=device, kernels=kernels, max_num_seqs=max_seqs, max_num_batched_tokens=4096, max_model_len=512,
        enable_prefix_caching=False, kv_cache_bytes=None if device != "cpu" else 256 << 20))


def engine_decode(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    from runtime.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
    sync(engine.device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync(engine.device)
    wall = time.perf_counter() - t0
    generated = sum(len(o.token_ids) for o in outs)
    return {"wall_s": wall, "generated": generated, "tok_s": generated / wall, "preemptions": engine.stats.preemptions}


def hf_model(model_dir: Path, device: torch.device):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


@torch.inference_mode()
def hf_decode(model, prompts: list[list[int]], new_tokens: int) -> dict:
    device = model.device
    ids = torch.tensor(prompts, device=device)  # equal lengths: no pad tokens needed
    mask = torch.ones_like(ids)
    kw = dict(do_sample=False, pad_token_id=0)
    model.generate(ids[:1, :16], attention_mask=mask[:1, :16], max_new_tokens=4, min_new_tokens=4, **kw)
    sync(device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    sync(device)
    wall = time.perf_counter() - t0
    generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"wall_s": wall, "generated": generated, "tok_s": generated / wall}


@torch.inference_mode()
def greedy_agreement(engine, model, prompts: list[list[int]], tokens: int) -> dict:
    """Per prompt: how many greedy tokens the engine and HF share, and whether they part only at
    one of HF's near-ties."""
    from runtime.engine.sampling import SamplingParams

    ours = engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    rows = []
    for p, o in zip(prompts, ours):
        ids = torch.tensor([p], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        theirs = out.sequences[0, len(p):].tolist()
        same = next((i for i, (a, b) in enumerate(zip(o.token_ids, theirs)) if a != b), tokens)
        tie, gap = True, None
        if same < tokens:
            top = out.scores[same][0].float().topk(2).values
            gap = float(top[0] - top[1])
            tie = gap < NEAR_TIE
        rows.append({"agree": same, "of": tokens, "parted_at_near_tie": tie, "hf_top2_gap": gap})
    return {"prompts": rows, "ok": all(r["parted_at_near_tie"] for r in rows)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="the bf16 reference (name or dir)")
    ap.add_argument("--checkpoints", nargs="*", default=[], help="further engine rows (e.g. a W4A16 checkpoint dir)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--agree-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from foundation.errors import KvslimError
    from foundation.model_source import resolve_model
    from runtime.device import Placement

    try:
        placement = Placement.resolve(args.device, args.kernels)
    except KvslimError as e:
        print(f"gpu_engine: {e}", file=sys.stderr)
        return 2
    base = resolve_model(args.model)
    prompts = real_prompts(base, max(4, *args.concurrency), args.prompt_tokens)
    hf = hf_model(base, placement.device)
    rows: dict[str, dict] = {"hf transformers bf16" if placement.device.type == "cuda" else "hf transformers fp32": {}}
    hf_name = next(iter(rows))
    for c in args.concurrency:
        rows[hf_name][c] = hf_decode(hf, prompts[:c], args.new_tokens)
        print(f"{hf_name:40s} c={c:4d} {rows[hf_name][c]['tok_s']:9.1f} tok/s", flush=True)
    agreement = {}
    for ckpt in [str(base), *args.checkpoints]:
        engine = engine_for(Path(resolve_model(ckpt)), args.device, args.kernels, max(args.concurrency))
        name = f"kvslim {Path(ckpt).name} ({placement.kernels}, {engine.model.activation_dtype.name})"
        if ckpt == str(base):
            agreement = greedy_agreement(engine, hf, prompts[:4], args.agree_tokens)
            print(f"greedy agreement vs HF: {[r['agree'] for r in agreement['prompts']]} of {args.agree_tokens} "
                  f"({'ok' if agreement['ok'] else 'DIFFERS outside near-ties'}; HF's top-2 logit gap where they part: "
                  f"{[r['hf_top2_gap'] and round(r['hf_top2_gap'], 3) for r in agreement['prompts']]})", flush=True)
        rows[name] = {}
        for c in args.concurrency:
            rows[name][c] = engine_decode(engine, prompts[:c], args.new_tokens)
            ratio = rows[name][c]["tok_s"] / rows[hf_name][c]["tok_s"]
            print(f"{name:40s} c={c:4d} {rows[name][c]['tok_s']:9.1f} tok/s  {ratio:5.2f}x HF", flush=True)
        del engine
        if placement.device.type == "cuda":  # give its KV pool back: the next engine sizes its own from free memory
            torch.cuda.empty_cache()
    doc = {"device": torch.cuda.get_device_name(placement.device) if placement.device.type == "cuda" else platform.processor(),
           "torch": torch.__version__, "kernels": placement.kernels, "prompt_tokens": args.prompt_tokens,
           "new_tokens": args.new_tokens, "greedy_agreement": agreement, "rows": rows}
    if args.json:
        from foundation.atomic import write_text_atomic

        write_text_atomic(args.json, json.dumps(doc, indent=2))
    return 0 if agreement.get("ok", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
