"""What `--lm-head int8 | int4 | bf16` costs in perplexity, beside the weight scheme's own cost.

    python benchmarks/lm_head_choice.py [--max-tokens 8192] [--json benchmarks/results/lm_head_choice.json]

For W8A16 and W4A16 (symmetric g32), RTN, ``--dtype bfloat16``: the checkpoint without an lm_head
option (the tied bf16 embedding serves as the lm_head) and with each ``--lm-head``. Perplexity on
the first ``--max-tokens`` of ``wikipedia:eval`` (context 512, stride 256) through transformers +
compressed-tensors at fp32 (the default route), so the figure does not depend on our runtime;
bytes: the checkpoint's safetensors. The lm_head's cost = ppl with it / ppl without it - 1.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from compress.quantize import quantize_checkpoint
from foundation.model_source import resolve_model
from foundation.perplexity import DEFAULT_CONTEXT, DEFAULT_STRIDE, hf_logits_fn, perplexity, tokenize_range
from foundation.schemes import W4A16, W8A16

TEXT = "wikipedia:eval"
RESULTS = Path(__file__).parent / "results" / "lm_head_choice.json"
SCHEMES = {"W8A16": W8A16, "W4A16": W4A16.with_options(group_size=32, symmetric=True)}
HEADS = (None, "bf16", "int8", "int4")


def ppl(path: Path, ids: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return perplexity(hf_logits_fn(model), ids, TEXT, DEFAULT_CONTEXT, DEFAULT_STRIDE).perplexity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(2)
    from transformers import AutoTokenizer

    src = resolve_model("smollm2")
    ids = tokenize_range(AutoTokenizer.from_pretrained(src), TEXT, max_tokens=args.max_tokens)
    original = ppl(src, ids)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvslim-lmhead-") as work:
        for name, scheme in SCHEMES.items():
            base = None
            for head in HEADS:
                out = Path(work) / f"{name}-{head}"
                quantize_checkpoint(src, out, scheme, progress=False, dtype=torch.bfloat16, lm_head=head)
                value = ppl(out, ids)
                base = value if head is None else base
                row = {"scheme": name, "lm_head": head or "tied (bf16 embedding)", "ppl": value,
                       "vs_original": value / original - 1, "lm_head_cost": value / base - 1,
                       "mib": sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**20}
                rows.append(row)
                print(json.dumps(row), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"text": TEXT, "max_tokens": args.max_tokens, "original_ppl": original,
                                     "rows": rows}, indent=2))
    print(f"\nppl on {TEXT}, first {args.max_tokens} tokens (original {original:.3f})")
    print(f"{'scheme':<7} {'lm_head':<22} {'MiB':>6} {'ppl':>8} {'vs orig':>8} {'head cost':>9}")
    for r in rows:
        print(f"{r['scheme']:<7} {r['lm_head']:<22} {r['mib']:>6.1f} {r['ppl']:>8.3f} {r['vs_original'] * 100:>+7.2f}% "
              f"{r['lm_head_cost'] * 100:>+8.2f}%")


if __name__ == "__main__":
    main()
