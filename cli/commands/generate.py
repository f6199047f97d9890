"""`compress generate [CKPT] "prompt" [--stats]`: continue a prompt with the kvslim runtime."""
from __future__ import annotations

import argparse

from runtime.cache.kv_dtype_choices import KV_CACHE_DTYPE_HELP, cache_kv_dtype, kv_cache_dtype_arg
from runtime.device_choices import DEVICE_HELP, DEVICES, KERNELS, KERNELS_HELP
from runtime.model.layers.dtype_choices import DTYPE_CHOICES, DTYPE_HELP


def add_parser(p: argparse.ArgumentParser) -> None:
    p.usage = "compress generate [options] [CKPT] PROMPT"
    p.add_argument("args", nargs="+", metavar="[CKPT] PROMPT",
                   help="checkpoint directory, .gguf file or known name (default: smollm2), then the prompt")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument("--kv-cache-dtype", default="auto", type=kv_cache_dtype_arg, help=KV_CACHE_DTYPE_HELP)
    p.add_argument("--device", default="auto", choices=DEVICES, help=DEVICE_HELP)
    p.add_argument("--kernels", default="auto", choices=KERNELS, help=KERNELS_HELP)
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--stats", action="store_true", help="print weight bytes and KV bytes per token")


def run(args: argparse.Namespace) -> int:
    import torch

    from foundation.errors import KvslimError
    from runtime.engine.sampling import SamplingParams
    from runtime.llm import LLM

    if len(args.args) > 2:
        raise KvslimError(f"expected [CKPT] PROMPT, got {len(args.args)} arguments (quote the prompt)")
    checkpoint, prompt = (None, args.args[0]) if len(args.args) == 1 else args.args
    if checkpoint is None and _names_a_model(prompt):
        raise KvslimError(f"missing PROMPT after {prompt} (usage: compress generate [CKPT] PROMPT)")
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed, stop=tuple(args.stop),
    )
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    llm = LLM(checkpoint, dtype=args.dtype, max_model_len=args.max_model_len,
              kv_cache_dtype=cache_kv_dtype(args.kv_cache_dtype), device=args.device, kernels=args.kernels)
    if args.chat:
        if llm.tokenizer is None or not getattr(llm.tokenizer, "chat_template", None):
            raise KvslimError(f"{llm.path}: no chat template in the tokenizer; drop --chat")
        prompt = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    out = llm.generate([prompt], params)[0]
    print(out.outputs[0].text)
    if args.stats:
        print(format_stats(llm, len(out.prompt_token_ids), out.outputs[0]))
    return 0


def _names_a_model(text: str) -> bool:
    """A lone argument that is a checkpoint path or model name was meant as CKPT, not as the prompt."""
    from pathlib import Path

    from foundation.model_source import NAMED_MODELS

    path = Path(text).expanduser()
    return text in NAMED_MODELS or path.is_dir() or (path.is_file() and path.suffix == ".gguf")


def _resident_note(model) -> str:
    from runtime.model.layers.linear import Fp8DequantizedLinear

    if any(isinstance(m, Fp8DequantizedLinear) for m in model.modules()):
        return "FP8 weights dequantized once at load: this CPU has no FP8 GEMM"
    return "quantized weights packed"


def format_stats(llm, num_prompt_tokens: int, completion) -> str:
    """Weight bytes (live tensors), the kernels chosen, KV bytes per token (layout formula), token counts."""
    from runtime.model.layers.linear import linear_kernels

    ctx = llm.max_model_len
    kv = llm.kv_bytes_per_token(ctx)
    kv_short = llm.kv_bytes_per_token(num_prompt_tokens + len(completion.token_ids))
    lines = [
        f"checkpoint: {llm.path}",
        f"activations: {llm.activation_dtype.describe()}",
        f"device: {llm.model.placement.describe()}",
        *([f"cpu kernels: {llm.model.cpu_kernels.describe()}"] if llm.model.cpu_kernels else []),
        f"weights: {llm.weight_bytes() / 2**20:.1f} MiB resident ({_resident_note(llm.model)})",
        "linear kernels (one per GEMM; q/k/v and gate/up fused): " + ", ".join(f"{k} x{n}" for k, n in linear_kernels(llm.model).items()),
        f"kv cache: {kv / 1024:.2f} KiB/token at context {ctx} ({llm.kv_cache_dtype}); "
        f"{kv_short / 1024:.2f} KiB/token at this request's {num_prompt_tokens + len(completion.token_ids)} tokens",
        f"tokens: {num_prompt_tokens} prompt + {len(completion.token_ids)} generated ({completion.finish_reason})",
    ]
    return "\n".join(lines)
