"""Peak memory of streamed quantization on a synthetic Llama-7B-shaped checkpoint.

    python benchmarks/quant_streaming_memory.py [--work /tmp/kvslim-7b] [--gptq-layers 2] [--keep]

1. Writes a random bf16 checkpoint shaped like Llama-2-7B (hidden 4096, MLP 11008, 32 layers,
   32 heads, untied lm_head; vocab 49152 so the default model's tokenizer can feed calibration
   text), one shard per layer, never holding more than one shard in memory (~13.8 GB on disk).
2. Runs ``compress quantize --int4`` (RTN) on it, then ``--int4 --method gptq`` with a few
   calibration samples, each in a fresh subprocess that samples its own ``RssAnon`` (anonymous
   resident memory; memory-mapped checkpoint pages do not count) from ``/proc/self/status``.
   GPTQ runs on the first ``--gptq-layers`` layers only (a view of the same shards whose config
   and index stop there; ``--gptq-layers 32`` is the whole model, ~38 min on 2 idle cores). A
   short view underestimates the peak: the pending output shard never fills in two layers.
3. Deletes the synthetic checkpoint and outputs (unless ``--keep``), writes
   ``benchmarks/results/quant_streaming_memory.json`` and prints a table.

Target (fixed before measuring): peak RssAnon <= 2 GiB for both runs. The machine is
shared by other jobs: wall times are noisy.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "quant_streaming_memory.json"
LIMIT_BYTES = 2 * 1024**3
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 32, "head_dim": 128, "vocab_size": 49152, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}


# --- the synthetic checkpoint --------------------------------------------------------------------
def layer_shapes(i: int) -> dict[str, tuple[int, ...]]:
    h, m, p = CONFIG["hidden_size"], CONFIG["intermediate_size"], f"model.layers.{i}."
    return {
        p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        **{p + f"self_attn.{n}.weight": (h, h) for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
        p + "mlp.gate_proj.weight": (m, h), p + "mlp.up_proj.weight": (m, h), p + "mlp.down_proj.weight": (h, m),
    }


def write_synthetic(out: Path, tokenizer_from: Path) -> int:
    """Random bf16 weights, one shard per decoder layer (+ one for embeddings and head)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    n = CONFIG["num_hidden_layers"]
    groups = [{"model.embed_tokens.weight": (CONFIG["vocab_size"], CONFIG["hidden_size"])}]
    groups += [layer_shapes(i) for i in range(n)]
    groups += [{"model.norm.weight": (CONFIG["hidden_size"],),
                "lm_head.weight": (CONFIG["vocab_size"], CONFIG["hidden_size"])}]
    weight_map, total = {}, 0
    for k, shapes in enumerate(groups):
        name = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for t, shape in shapes.items():
            if len(shape) == 1:
                tensors[t] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[t] = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
            weight_map[t] = name
            total += tensors[t].numel() * 2
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2))
    for f in tokenizer_from.glob("tokenizer*"):
        shutil.copy2(f, out / f.name)
    return total


def first_layers_view(src: Path, out: Path, layers: int) -> None:
    """A checkpoint of the first ``layers`` layers: symlinked shards, trimmed config and index."""
    out.mkdir(parents=True, exist_ok=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    keep = {t: f for t, f in index["weight_map"].items()
            if not t.startswith("model.layers.") or int(t.split(".")[2]) < layers}
    for f in set(keep.values()):
        (out / f).symlink_to(src / f)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": keep}))
    (out / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": layers}, indent=2))
    for f in src.glob("tokenizer*"):
        shutil.copy2(f, out / f.name)


# --- one measured run (child process) --------------------------------------------------------------
def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def child(argv: list[str]) -> None:
    from cli.main import main

    torch.set_num_threads(2)
    peak = [_rss_anon()]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_anon())
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    rc = main(argv)
    seconds = time.perf_counter() - start
    done.set()
    thread.join()
    peak[0] = max(peak[0], _rss_anon())
    print("RESULT " + json.dumps({"rc": rc, "seconds": seconds, "peak_rss_anon": peak[0]}), flush=True)


def measure(argv: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    print("\n".join(ln for ln in proc.stdout.splitlines() if not ln.startswith("RESULT "))[-3000:])
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/kvslim-7b"))
    parser.add_argument("--gptq-layers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--only", default="rtn,gptq")
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint and outputs")
    args = parser.parse_args()
    from compress.algorithms.gptq import default_options
    from foundation.model_source import resolve_model
    from foundation.schemes import default_scheme

    free = shutil.disk_usage(args.work.parent).free
    print(f"free disk under {args.work.parent}: {free / 2**30:.1f} GiB")
    if free < 24 * 2**30:
        raise SystemExit("need ~24 GiB free (13.8 GB checkpoint + outputs)")
    src = args.work / "llama7b-synthetic"
    # Rows of runs not repeated (--only) are kept from the previous results.
    rows: dict[str, dict] = json.loads(RESULTS.read_text())["rows"] if RESULTS.is_file() else {}
    rerun = {f"int4_{run}" for run in args.only.split(",")}
    rows = {k: v for k, v in rows.items() if k not in rerun and "seconds" in v}
    try:
        if not (src / "config.json").is_file():
            start = time.perf_counter()
            total = write_synthetic(src, resolve_model("smollm2"))
            print(f"wrote {total / 1e9:.1f} GB synthetic checkpoint in {time.perf_counter() - start:.0f} s")
        params = sum(json.loads((src / "model.safetensors.index.json").read_text())["metadata"].values()) // 2
        if "rtn" in args.only:
            r = measure(["quantize", str(src), "--int4", "-o", str(args.work / "int4-rtn"), "--force", "--no-progress"])
            rows["int4_rtn"] = {**r, "layers": CONFIG["num_hidden_layers"], "calibration": None,
                                "scheme": default_scheme("int4").describe()}
            shutil.rmtree(args.work / "int4-rtn", ignore_errors=True)
        if "gptq" in args.only:
            view = args.work / f"llama7b-first{args.gptq_layers}"
            shutil.rmtree(view, ignore_errors=True)
            first_layers_view(src, view, args.gptq_layers)
            r = measure(["quantize", str(view), "--int4", "--method", "gptq", "--num-calib-samples", str(args.samples),
                         "--calib-seq-len", str(args.seq_len), "-o", str(args.work / "int4-gptq"), "--force",
                         "--no-progress"])
            rows["int4_gptq"] = {**r, "layers": args.gptq_layers,
                                 "calibration": f"wikipedia:calib, {args.samples} x {args.seq_len} tokens",
                                 "scheme": default_scheme("int4").describe(),
                                 "gptq": str(default_options(default_scheme("int4")))}
            shutil.rmtree(args.work / "int4-gptq", ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    print(f"\nsynthetic Llama-7B-shaped checkpoint ({params / 1e9:.2f}B params, bf16), {default_scheme('int4').describe()}; "
          f"peak RssAnon target <= {LIMIT_BYTES / 2**30:.0f} GiB")
    print(f"{'run':<10} {'layers':>6} {'peak RssAnon':>13} {'wall s':>8} {'s/layer':>8}  target")
    for k, r in rows.items():
        ok = "met" if r["peak_rss_anon"] <= LIMIT_BYTES else "MISSED"
        print(f"{k:<10} {r['layers']:>6} {r['peak_rss_anon'] / 2**30:>9.2f} GiB {r['seconds']:>8.0f} "
              f"{r['seconds'] / r['layers']:>8.1f}  {ok}")
        r["meets_target"] = r["peak_rss_anon"] <= LIMIT_BYTES
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "checkpoint": {**CONFIG, "params": params}, "scheme": "kvslim's --int4 default when run (per row)",
        "limit_bytes": LIMIT_BYTES, "threads": 2,
        "machine": f"{os.cpu_count()} CPUs shared with other jobs (load average {os.getloadavg()[0]:.1f} at write)",
        "rows": rows,
    }, indent=2) + "\n")


if __name__ == "__main__":
    main()
