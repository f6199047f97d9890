"""Decode on one GPU, side by side in one run (``make bench-gpu``): the engine eager and with CUDA
graphs against HF transformers eager and HF's fastest (``generate(cache_implementation="static")``:
torch.compile and CUDA graphs), then KV dtypes at long context on a Llama-3-8B-shaped model.

Part 1, SmolLM2-135M's shapes (its real weights with ``--model DIR``; by default random weights of
its shape, built on the machine: no download). Prompts of 128 random token ids, 128 new tokens
each, greedy, EOS ignored, at 1 / 8 / 32 / 128 requests. Throughput = generated tokens / wall time
from submit to the last token (prefill included). Every side is warmed by full-size runs first
(HF static's warm-up compiles). Greedy agreement: 4 prompts x 32 tokens of each side against an
fp32 HF reference; where a side parts from it, the reference's top-2 logit gap there is reported
(a bf16 side may part at a near-tie).

Part 2, a Llama-3-8B-shaped model (32 layers, 32 heads, 8 KV heads x 128) with random weights:
``--kv-seqs`` sequences of ``--kv-context`` random tokens, then 64 new tokens, per KV dtype (bf16,
fp8, int8, int4, k4v2, k3v2, int2) in one fixed KV budget: decode tok/s once every sequence has its
first token (pure decode steps), and the most ``--kv-context``-token sequences the budget holds, counted by
allocating blocks in the engine's real pool.

    python benchmarks/gpu_decode.py --json benchmarks/results/gpu_decode.json
    python benchmarks/gpu_decode.py --concurrency 1 --new-tokens 8 --kv-dtypes bf16 --kv-layers 2   # smoke

Without CUDA it prints one line and exits 2. A part that fails is reported and the rest still runs.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a script

SMOLLM2 = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
               max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
               hidden_act="silu", bos_token_id=1, eos_token_id=2)
LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, hidden_act="silu", bos_token_id=128000, eos_token_id=128001)
NEAR_TIE = 0.05  # an fp32 top-2 gap under this: a bf16 side may pick either
DEVICE = torch.device("cuda")  # --device cpu: a smoke run of the script's own logic (eager torch kernels)


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def free_cached() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (n, length), generator=g).tolist()


def random_checkpoint(config: dict, out: Path) -> Path:
    """A bf16 checkpoint of ``config``'s shape with transformers' own random initialisation."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with DEVICE:
        model = LlamaForCausalLM(LlamaConfig(**config)).to(torch.bfloat16)
    model.save_pretrained(out)
    return out


# --------------------------------------------------------------------------- part 1
def hf_side(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEVICE).eval()


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], new_tokens: int, static: bool, scores: bool = False):
    ids = torch.tensor(prompts, device=DEVICE)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              do_sample=False, pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"
    if scores:
        kw.update(output_scores=True, return_dict_in_generate=True)
    return model.generate(ids, **kw)


def hf_rate(model, prompts, new_tokens: int, static: bool) -> dict:
    hf_generate(model, prompts, new_tokens, static)  # full-size warm-up (HF static compiles here)
    sync()
    t0 = time.perf_counter()
    out = hf_generate(model, prompts, new_tokens, static)
    sync()
    wall = time.perf_counter() - t0
    generated = (out.shape[1] - len(prompts[0])) * len(prompts)
    return {"tok_s": generated / wall, "wall_s": wall}


def engine_for(path: Path, max_seqs: int, eager: bool, max_model_len: int, **config):
    from runtime.engine.engine import Engine, EngineConfig

    engine = Engine.from_checkpoint(path, EngineConfig(
        device=DEVICE.type, kernels="triton" if DEVICE.type == "cuda" else "torch", max_num_seqs=max_seqs, max_model_len=max_model_len,
        max_num_batched_tokens=8192, enable_prefix_caching=False, enforce_eager=eager, **config))
    if engine.cuda_graphs is not None:
        engine.cuda_graphs.capture_all()
    return engine


def engine_rate(engine, prompts, new_tokens: int) -> dict:
    from runtime.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.generate(prompts, params)  # full-size warm-up
    sync()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync()
    wall = time.perf_counter() - t0
    return {"tok_s": sum(len(o.token_ids) for o in outs) / wall, "wall_s": wall}


def agreement(tokens: list[list[int]], reference) -> dict:
    """Per prompt: tokens equal to the fp32 reference's greedy ones until they part, and the
    reference's top-2 logit gap where they part."""
    rows = []
    ref_tokens = reference.sequences[:, -len(tokens[0]):].tolist()
    for p, (ours, theirs) in enumerate(zip(tokens, ref_tokens)):
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
        gap = None
        if same < len(theirs):
            top = reference.scores[same][p].float().topk(2).values
            gap = round(float(top[0] - top[1]), 4)
        rows.append({"agree": same, "of": len(theirs), "fp32_top2_gap_where_parted": gap})
    return {"prompts": rows, "parted_only_at_near_ties": all(r["fp32_top2_gap_where_parted"] is None or
                                                             r["fp32_top2_gap_where_parted"] < NEAR_TIE for r in rows)}


def part_one(path: Path, args, doc: dict, save) -> None:
    """HF eager, the engine eager and graphed, then HF static (its compiles last: the longest part)."""
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(max(args.concurrency), args.prompt_tokens, vocab, seed=1)
    agree_prompts = random_prompts(4, args.prompt_tokens, vocab, seed=2)
    ref = hf_generate(hf_side(path, torch.float32), agree_prompts, args.agree_tokens, static=False, scores=True)
    free_cached()
    rows, agree = doc.setdefault("rows", {}), doc.setdefault("greedy_vs_fp32", {})
    n = args.agree_tokens

    def measure(name: str, greedy, rate) -> None:
        try:
            agree[name] = agreement(greedy(), ref)
            rows[name] = {}
            for c in (args.hf_static_concurrency if "static" in name else args.concurrency):
                rows[name][c] = rate(prompts[:c])
                print(f"{name:34s} c={c:4d} {rows[name][c]['tok_s']:10.1f} tok/s", flush=True)
                save()
        except Exception as e:  # noqa: BLE001 - reported, and the other rows still run
            doc.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()

    hf = hf_side(path, torch.bfloat16)

    def hf_greedy(static: bool) -> list[list[int]]:  # one prompt at a time: the timed runs' shapes, no new compile
        return [hf_generate(hf, [p], args.new_tokens, static)[0, -args.new_tokens:][:n].tolist() for p in agree_prompts]

    measure("HF eager bf16", lambda: hf_greedy(False), lambda ps: hf_rate(hf, ps, args.new_tokens, static=False))
    for name, eager in (("kvslim eager bf16", True), ("kvslim CUDA graphs bf16", False)):
        engine = None
        try:
            engine = engine_for(path, max(args.concurrency), eager, args.prompt_tokens + args.new_tokens + 8)
        except Exception as e:  # noqa: BLE001
            doc.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            continue
        measure(name, lambda: [o.token_ids[:n] for o in engine.generate(agree_prompts, greedy_params(args.new_tokens))],
                lambda ps: engine_rate(engine, ps, args.new_tokens))
        if engine.cuda_graphs is not None:
            doc["captured_buckets"] = engine.cuda_graphs.captured_buckets
        engine = None  # its KV pool goes before the next one is sized
        free_cached()
    if args.hf_static_concurrency:
        measure("HF static cache + compile bf16", lambda: hf_greedy(True),
                lambda ps: hf_rate(hf, ps, args.new_tokens, static=True))
    hf = None
    free_cached()


def greedy_params(new_tokens: int):
    from runtime.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)


# --------------------------------------------------------------------------- part 2
class RandomCheckpoint:
    """A Llama checkpoint that exists only as shapes: ``get`` returns random bf16 tensors (a random
    tile repeated: building 8B independent random numbers would dominate the run)."""

    def __init__(self, config: dict):
        from foundation.checkpoint import Checkpoint

        self.ckpt = Checkpoint(path=Path("random-llama3-8b-shape"), config=config)
        h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
        q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
        shapes = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,),
                  "lm_head.weight": (config["vocab_size"], h)}
        for n in range(config["num_hidden_layers"]):
            p = f"model.layers.{n}."
            shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                           p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                           p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                           p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                           p + "mlp.down_proj.weight": (h, i)})
        self.ckpt.weight_map = {name: Path("random") for name in shapes}
        self.ckpt.headers = {name: ("BF16", shape) for name, shape in shapes.items()}
        self.ckpt.get = self.get  # the loader reads through Checkpoint.get
        self.tile = torch.randn(4096, generator=torch.Generator().manual_seed(0)).bfloat16()

    def get(self, name: str) -> torch.Tensor:
        shape = self.ckpt.headers[name][1]
        if len(shape) == 1:
            return torch.ones(shape, dtype=torch.bfloat16)
        n = shape[0] * shape[1]
        reps = -(-n // self.tile.numel())
        scale = shape[1] ** -0.5
        return (self.tile.repeat(reps)[:n] * scale).view(shape)


def part_two(args, doc: dict, save) -> None:
    from runtime.cache.kv_report import measure_capacity
    from runtime.device import Placement
    from runtime.engine.engine import Engine, EngineConfig
    from runtime.engine.sampling import SamplingParams
    from runtime.model.loader import load_model

    config = {**LLAMA3_8B, "num_hidden_layers": args.kv_layers}
    t0 = time.perf_counter()
    model = load_model(RandomCheckpoint(config).ckpt, "bfloat16", placement=Placement.resolve(DEVICE.type, "auto"))
    print(f"8B-shaped model ({args.kv_layers} layers) built in {time.perf_counter() - t0:.0f} s", flush=True)
    prompts = random_prompts(args.kv_seqs, args.kv_context, config["vocab_size"], seed=3)
    new = 64
    rows = doc.setdefault("kv_rows", {})
    for kv in args.kv_dtypes:
        try:
            engine = Engine(model, EngineConfig(kv_dtype=kv, kv_cache_bytes=args.kv_budget_gib << 30,
                                                max_model_len=args.kv_context + new, max_num_seqs=args.kv_seqs,
                                                max_num_batched_tokens=8192, enable_prefix_caching=False))
            graphed = engine.cuda_graphs is not None
            if graphed:
                engine.cuda_graphs.capture_all()
            capacity, _ = measure_capacity(engine.kv_spec, engine.cache.num_blocks, args.kv_context)
            params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
            engine.generate([p[:256] for p in prompts[:2]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
            sync()
            first: dict[int, float] = {}
            counts: dict[int, int] = {}
            t_start = time.perf_counter()
            for o in engine.stream(prompts, params):
                now = time.perf_counter()
                first.setdefault(o.request_id, now)
                counts[o.request_id] = len(o.token_ids)
            sync()
            t_end = time.perf_counter()
            decoding_from = max(first.values())
            after = sum(counts.values()) - len(counts)  # tokens after each sequence's first
            rows[kv] = {"decode_tok_s": after / (t_end - decoding_from), "prefill_s": decoding_from - t_start,
                        "capacity_seqs": capacity, "kv_bytes_per_token": engine.kv_spec.block_bytes(0) / engine.block_size,
                        "cuda_graphs": graphed, "seqs": len(prompts), "context": args.kv_context}
            base = rows.get("bf16", rows[kv])["decode_tok_s"]
            print(f"KV {kv:9s} decode {rows[kv]['decode_tok_s']:9.1f} tok/s ({rows[kv]['decode_tok_s'] / base:.2f}x bf16)"
                  f"  holds {capacity} x {args.kv_context}  {'graphs' if graphed else 'eager'}", flush=True)
            save()
            del engine
            free_cached()
        except Exception as e:  # noqa: BLE001
            doc.setdefault("errors", {})[f"kv {kv}"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()


def table(doc: dict) -> str:
    lines = []
    rows = doc.get("rows", {})
    if rows:
        cs = sorted({c for r in rows.values() for c in r})
        hf = rows.get("HF static cache + compile bf16", {})
        n = next((p["of"] for a in doc.get("greedy_vs_fp32", {}).values() for p in a["prompts"]), 0)
        lines.append("| decode tok/s | " + " | ".join(f"{c} req" for c in cs)
                     + f" | greedy vs fp32 (tokens agreed of {n}, per prompt) |")
        lines.append("|---|" + "---:|" * len(cs) + "---|")
        for name, r in rows.items():
            cells = []
            for c in cs:
                if c not in r:
                    cells.append("-")
                    continue
                ratio = f" ({r[c]['tok_s'] / hf[c]['tok_s']:.2f}x)" if c in hf and name.startswith("kvslim") else ""
                cells.append(f"{r[c]['tok_s']:,.1f}{ratio}")
            a = doc.get("greedy_vs_fp32", {}).get(name)
            agreed = "-" if a is None else " ".join(str(p["agree"]) for p in a["prompts"])
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {agreed} |")
    kv = doc.get("kv_rows", {})
    if kv:
        lines += ["", "| KV dtype | decode tok/s | x bf16 | seqs held | path |", "|---|---:|---:|---:|---|"]
        base = kv.get("bf16", next(iter(kv.values())))["decode_tok_s"]
        for name, r in kv.items():
            lines.append(f"| {name} | {r['decode_tok_s']:,.1f} | {r['decode_tok_s'] / base:.2f}x | {r['capacity_seqs']} | "
                         f"{'CUDA graphs' if r['cuda_graphs'] else 'eager'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a checkpoint dir (default: random weights of SmolLM2-135M's shape)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--hf-static-concurrency", type=int, nargs="*", default=[1, 8, 32, 128],
                    help="HF static's sizes (each one compiles; default: those of --concurrency's default)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--agree-tokens", type=int, default=32)
    ap.add_argument("--kv-dtypes", nargs="*", default=["bf16", "fp8_e4m3", "int8", "int4", "k4v2", "k3v2", "int2"])
    ap.add_argument("--kv-layers", type=int, default=32)
    ap.add_argument("--kv-seqs", type=int, default=32)
    ap.add_argument("--kv-context", type=int, default=4096)
    ap.add_argument("--kv-budget-gib", type=int, default=18)
    ap.add_argument("--skip", choices=["small", "kv"], default=None, help="leave out one part")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a smoke run of the script itself (no HF static, torch kernels)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        print("gpu_decode: needs a CUDA GPU (none is visible)", file=sys.stderr)
        return 2
    doc = {"device": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu", "torch": torch.__version__, "prompt_tokens": args.prompt_tokens,
           "new_tokens": args.new_tokens}

    def save() -> None:  # after every row: a run stopped by a time limit keeps what it measured
        if args.json:
            from foundation.atomic import write_text_atomic

            write_text_atomic(args.json, json.dumps(doc, indent=2))

    try:
        import transformers
        import triton

        doc.update(transformers=transformers.__version__, triton=triton.__version__)
        if args.skip != "small":
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(args.model) if args.model else random_checkpoint(SMOLLM2, Path(tmp) / "smollm2-shape")
                doc["model"] = str(args.model or "random weights, SmolLM2-135M's shape")
                part_one(path, args, doc, save)
        if args.skip != "kv" and args.kv_dtypes:
            part_two(args, doc, save)
    finally:
        print(table(doc))
        save()
    return 1 if doc.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
