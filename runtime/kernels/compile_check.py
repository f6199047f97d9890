"""Compile every Triton kernel for a Hopper (sm_90) target on a machine without a GPU.

Triton lowers to PTX and runs its bundled ``ptxas`` on the CPU, so a kernel that only ever ran
in the interpreter (which accepts things the compiler rejects) fails here. Run as
``python -m runtime.kernels.compile_check [--json OUT] [--quick]``; needs ``TRITON_INTERPRET``
unset (the interpreter replaces kernels with Python functions that cannot be compiled).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace

from foundation.errors import KvslimError
from runtime.cache.low_bit_kv import CLIPPED_KEY_BITS, KEYS_BEFORE_ROPE_BITS, LOW_BIT_KV, packed_dim
from runtime.kernels.packed_kv_store import clip_steps, key_tile_width, quantize_num_warps
from runtime.kernels.packed_paged_attention import key_tile
from runtime.kernels.paged_attention import attention_num_warps

SM90 = ("cuda", 90, 32)  # backend, compute capability, warp size
H100_SHARED_BYTES = 227 * 1024  # opt-in shared memory per block on sm_90

# Scalar arguments that are floats; every other non-pointer, non-constexpr argument is i32.
FLOAT_ARGS = {"sm_scale", "softcap", "rope_scaling", "eps", "offset"}


@dataclass(frozen=True)
class KernelVariant:
    """One specialisation of a kernel: pointer dtypes (Triton names) and constexpr values."""

    name: str
    kernel: str  # attribute name of the @triton.jit function in its module
    module: str
    pointers: dict = field(default_factory=dict)
    constexprs: dict = field(default_factory=dict)
    quick: bool = False  # part of the CI subset
    num_warps: int = 4  # as the wrapper launches it


def _int_variants() -> list[KernelVariant]:
    out = []
    decode = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128)
    prefill = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64)
    for bits in (4, 8):
        for has_zp in (False, True):
            for g_idx in (False, True):
                quick = (bits, has_zp, g_idx) in ((4, False, False), (4, True, True), (8, False, False))
                out.append(KernelVariant(
                    f"int{bits} {'asym' if has_zp else 'sym'}{' g_idx' if g_idx else ''} bf16 decode",
                    "int_weight_matmul_kernel", "runtime.kernels.dequant_matmul",
                    {"x_ptr": "*bf16", "packed_ptr": "*i32", "scale_ptr": "*bf16", "zp_ptr": "*i32",
                     "g_idx_ptr": "*i32", "out_ptr": "*fp32"},
                    dict(BITS=bits, HAS_ZP=has_zp, HAS_G_IDX=g_idx, TILE_IN_GROUP=not g_idx,
                         **{**decode, "BLOCK_K": 64 if g_idx else 128}), quick))
    out.append(KernelVariant("int4 sym per-weight scales bf16 decode", "int_weight_matmul_kernel", "runtime.kernels.dequant_matmul",
                             {"x_ptr": "*bf16", "packed_ptr": "*i32", "scale_ptr": "*bf16", "zp_ptr": "*i32",
                              "g_idx_ptr": "*i32", "out_ptr": "*fp32"},
                             dict(BITS=4, HAS_ZP=False, HAS_G_IDX=False, TILE_IN_GROUP=False, **{**decode, "BLOCK_K": 64})))
    out.append(KernelVariant("int4 sym fp16 prefill", "int_weight_matmul_kernel", "runtime.kernels.dequant_matmul",
                             {"x_ptr": "*fp16", "packed_ptr": "*i32", "scale_ptr": "*fp16", "zp_ptr": "*i32",
                              "g_idx_ptr": "*i32", "out_ptr": "*fp16"},
                             dict(BITS=4, HAS_ZP=False, HAS_G_IDX=False, TILE_IN_GROUP=True, **prefill), True, num_warps=8))
    out.append(KernelVariant("int8 sym bf16 prefill", "int_weight_matmul_kernel", "runtime.kernels.dequant_matmul",
                             {"x_ptr": "*bf16", "packed_ptr": "*i32", "scale_ptr": "*fp32", "zp_ptr": "*i32",
                              "g_idx_ptr": "*i32", "out_ptr": "*bf16"},
                             dict(BITS=8, HAS_ZP=False, HAS_G_IDX=False, TILE_IN_GROUP=True, **prefill), num_warps=8))
    return out


def _mid_variants() -> list[KernelVariant]:
    """The 16 < M <= 64 tiles."""
    return [KernelVariant("int4 asym bf16 mid-M", "int_weight_matmul_kernel", "runtime.kernels.dequant_matmul",
                          {"x_ptr": "*bf16", "packed_ptr": "*i32", "scale_ptr": "*bf16", "zp_ptr": "*i32",
                           "g_idx_ptr": "*i32", "out_ptr": "*bf16"},
                          dict(BITS=4, HAS_ZP=True, HAS_G_IDX=False, TILE_IN_GROUP=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64))]


def _fp8_variants() -> list[KernelVariant]:
    mod, k = "runtime.kernels.dequant_matmul", "fp8_weight_matmul_kernel"
    return [
        KernelVariant("fp8 weight bf16 decode", k, mod,
                      {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "out_ptr": "*fp32"},
                      dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128), True),
        KernelVariant("fp8 weight fp16 prefill", k, mod,
                      {"x_ptr": "*fp16", "w_ptr": "*fp8e4nv", "scale_ptr": "*bf16", "out_ptr": "*fp16"},
                      dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64), num_warps=8),
    ]


def _attention_variants() -> list[KernelVariant]:
    mod, k = "runtime.kernels.paged_attention", "paged_attention_kernel"
    out = []
    cases = [  # (name, q, cache, exact reads, per_token, D, QPK, decode, splits, window, softcap, quick)
        # exact reads over a quantized cache: "new", the step's new rows (FRESH); "own", each token
        # only its own row (OWN_ROW, Engine.score); None: an unquantized cache
        ("bf16 kv decode d64 gqa3", "bf16", "bf16", None, False, 64, 3, True, 1, False, False, True),
        ("bf16 kv decode split d128 gqa4", "bf16", "bf16", None, False, 128, 4, True, 8, False, False, False),
        ("fp8 kv/token decode split d64", "bf16", "fp8e4nv", "new", True, 64, 3, True, 4, False, False, True),
        ("int8 kv/token prefill window d64", "bf16", "i8", "new", True, 64, 3, False, 1, True, False, True),
        ("fp8 kv/scalar prefill softcap d256 mqa", "fp16", "fp8e4nv", "new", False, 256, 8, False, 1, True, True, False),
        ("fp16 kv prefill d128 mha", "fp16", "fp16", None, False, 128, 1, False, 1, False, False, False),
        ("bf16 kv decode split d128 mqa32", "bf16", "bf16", None, False, 128, 32, True, 4, False, False, False),
        ("int8 kv/token decode window d256 gqa4", "bf16", "i8", "new", True, 256, 4, True, 1, True, False, False),
        ("fp8 kv/token prefill own row d64", "bf16", "fp8e4nv", "own", True, 64, 3, False, 1, False, False, True),
        ("int8 kv/token decode split own row d64", "bf16", "i8", "own", True, 64, 3, True, 4, True, False, True),
    ]
    for name, qd, cd, reads, per_token, d, qpk, decode, splits, window, softcap, quick in cases:
        quant = reads is not None
        block_m = max(16, 1 << (qpk - 1).bit_length()) if decode else max(64, 1 << (qpk - 1).bit_length())
        ptrs = {"q_ptr": f"*{qd}", "k_cache_ptr": f"*{cd}", "v_cache_ptr": f"*{cd}",
                "k_new_ptr": f"*{qd}", "v_new_ptr": f"*{qd}",
                "k_scale_ptr": "*fp32" if quant else f"*{cd}", "v_scale_ptr": "*fp32" if quant else f"*{cd}",
                "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "query_start_ptr": "*i32",
                "out_ptr": "*fp32" if splits > 1 else f"*{qd}", "lse_ptr": "*fp32" if splits > 1 else f"*{qd}"}
        consts = dict(QPK=qpk, HEAD_DIM=d, BLOCK_D=d, BLOCK_M=block_m, BLOCK_Q=block_m // qpk,
                      BLOCK_N=32 if d <= 128 else 16, NUM_SPLITS=splits, KV_QUANT=quant,
                      SCALE_PER_TOKEN=per_token, USE_WINDOW=window, USE_SOFTCAP=softcap,
                      FRESH=reads == "new", OWN_ROW=reads == "own")
        out.append(KernelVariant(name, k, mod, ptrs, consts, quick, num_warps=attention_num_warps(block_m, d)))
    return out


def _store_variants() -> list[KernelVariant]:
    mod, k = "runtime.kernels.kv_store", "store_kv_kernel"
    out = []
    for name, x, cache, quant, per_token, is_int8, qmax, quick in (
        ("store bf16", "bf16", "bf16", False, False, False, 1.0, True),
        ("store fp8/token", "bf16", "fp8e4nv", True, True, False, 448.0, True),
        ("store int8/token", "fp16", "i8", True, True, True, 127.0, True),
        ("store fp8/scalar", "bf16", "fp8e4nv", True, False, False, 448.0, False),
    ):
        scale = "*fp32" if quant else f"*{cache}"
        out.append(KernelVariant(name, k, mod,
                                 {"k_ptr": f"*{x}", "v_ptr": f"*{x}", "k_cache_ptr": f"*{cache}", "v_cache_ptr": f"*{cache}",
                                  "k_scale_ptr": scale, "v_scale_ptr": scale, "slot_ptr": "*i64"},
                                 dict(QUANT=quant, SCALE_PER_TOKEN=per_token, IS_INT8=is_int8, QMAX_=qmax, MIN_SCALE_=1e-8,
                                      BLOCK_H=8, BLOCK_D=128), quick))
    return out


def _packed_variants() -> list[KernelVariant]:
    """The packed low-bit KV store, block quantization and attention (``packed_*`` modules)."""
    store_mod, attn_mod = "runtime.kernels.packed_kv_store", "runtime.kernels.packed_paged_attention"
    out = [KernelVariant("packed store bf16 residual", "residual_store_kernel", store_mod,
                         {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_residual_ptr": "*bf16", "v_residual_ptr": "*bf16",
                          "slot_of_ptr": "*i64", "slot_ptr": "*i64"}, dict(BLOCK_H=8, BLOCK_D=128), True)]
    for kv, residual, d, quick in (("int4", "bf16", 128, True), ("int2", "fp16", 64, True), ("k4v2", "bf16", 64, True),
                                       ("k3v2", "bf16", 128, True)):
        bits = LOW_BIT_KV[kv]
        out.append(KernelVariant(
            f"quantize {kv} blocks {residual} d{d}", "quantize_blocks_kernel", store_mod,
            {"k_ptr": f"*{residual}", "v_ptr": f"*{residual}", "k_residual_ptr": f"*{residual}",
             "v_residual_ptr": f"*{residual}", "full_slot_ptr": "*i64", "blocks_ptr": "*i64", "src_ptr": "*i64",
             "first_ptr": "*i1",
             "k_codes_ptr": "*u8", "v_codes_ptr": "*u8", "k_scale_ptr": "*fp16", "k_min_ptr": "*fp16",
             "v_scale_ptr": "*fp16", "v_min_ptr": "*fp16"},
            dict(KEY_BITS=bits.keys, VALUE_BITS=bits.values, BLOCK_S=64, BLOCK_P=key_tile_width(bits.keys, d),
                 BLOCK_VP=packed_dim(d, bits.values), MIN_SCALE_=1e-6, CLIP_STEPS=clip_steps(bits.keys in CLIPPED_KEY_BITS)), quick,
            num_warps=quantize_num_warps(64, d)))
    cases = [  # (name, q, residual, KV dtype, D, QPK, decode, splits, block size, window, softcap, fresh, quick)
        ("int4 kv decode d64 gqa3", "bf16", "bf16", "int4", 64, 3, True, 1, 64, False, False, True, True),
        ("int4 kv decode split d128 gqa4", "bf16", "bf16", "int4", 128, 4, True, 8, 64, False, False, True, False),
        ("int4 kv decode shared-KV d128 gqa4", "bf16", "bf16", "int4", 128, 4, True, 1, 64, False, False, False, False),
        ("int2 kv prefill window d128 gqa4", "bf16", "bf16", "int2", 128, 4, False, 1, 64, True, False, True, True),
        ("int4 kv/block 8 decode d128 gqa4", "bf16", "bf16", "int4", 128, 4, True, 1, 8, False, False, True, True),
        ("int4 kv prefill softcap d256 mqa", "fp16", "fp16", "int4", 256, 8, False, 1, 64, True, True, True, False),
        ("int2 kv decode d64 gqa3", "bf16", "bf16", "int2", 64, 3, True, 1, 64, False, False, True, True),
        ("int2 kv/block 8 decode split d128 gqa4", "bf16", "bf16", "int2", 128, 4, True, 4, 8, False, False, True, False),
        ("k4v2 kv decode d64 gqa3", "bf16", "bf16", "k4v2", 64, 3, True, 1, 64, False, False, True, True),
        ("k4v2 kv/block 8 prefill d128 gqa4", "bf16", "bf16", "k4v2", 128, 4, False, 1, 8, False, False, True, True),
        ("k3v2 kv decode d64 gqa3", "bf16", "bf16", "k3v2", 64, 3, True, 1, 64, False, False, True, True),
        ("k3v2 kv/block 8 decode split d128 gqa4", "bf16", "bf16", "k3v2", 128, 4, True, 4, 8, False, False, True, True),
    ]
    for name, qd, rd, kv, d, qpk, decode, splits, block_size, window, softcap, fresh, quick in cases:
        bits = LOW_BIT_KV[kv]
        block_m = max(16, 1 << (qpk - 1).bit_length()) if decode else max(64, 1 << (qpk - 1).bit_length())
        ptrs = {"q_ptr": f"*{qd}", "k_new_ptr": f"*{qd}", "v_new_ptr": f"*{qd}", "k_codes_ptr": "*u8", "v_codes_ptr": "*u8",
                "k_scale_ptr": "*fp16", "k_min_ptr": "*fp16",
                "v_scale_ptr": "*fp16", "v_min_ptr": "*fp16", "k_residual_ptr": f"*{rd}", "v_residual_ptr": f"*{rd}",
                "slot_of_ptr": "*i64", "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "query_start_ptr": "*i32",
                "out_ptr": "*fp32" if splits > 1 else f"*{qd}", "lse_ptr": "*fp32" if splits > 1 else f"*{qd}",
                "inv_freq_ptr": "*fp32"}
        block_n, in_block = key_tile(block_size, d)
        consts = dict(KEY_BITS=bits.keys, VALUE_BITS=bits.values, QPK=qpk, HEAD_DIM=d, BLOCK_D=d, BLOCK_M=block_m,
                      BLOCK_Q=block_m // qpk, BLOCK_N=block_n, NUM_SPLITS=splits, TILE_IN_BLOCK=in_block,
                      USE_WINDOW=window, USE_SOFTCAP=softcap, FRESH=fresh, ROPE=bits.keys in KEYS_BEFORE_ROPE_BITS)
        out.append(KernelVariant(name, "packed_paged_attention_kernel", attn_mod, ptrs, consts, quick,
                                 num_warps=attention_num_warps(block_m, d)))
    return out


def _sink_variants() -> list[KernelVariant]:
    """Sliding-window attention with attention sinks (the extra sink tiles), both layouts."""
    windowed = {"int8 kv/token prefill window d64": "int8 kv/token prefill window sinks d64",
                "int2 kv prefill window d128 gqa4": "int2 kv prefill window sinks d128 gqa4"}
    return [replace(v, name=windowed[v.name], constexprs={**v.constexprs, "USE_SINKS": True})
            for v in _attention_variants() + _packed_variants() if v.name in windowed]


def _small_op_variants() -> list[KernelVariant]:
    """The fused small ops of a decode step: residual add + RMSNorm, rotary, gated activation, and
    the merge of attention splits."""
    norm = "runtime.kernels.add_rms_norm"
    out = [KernelVariant(f"add_rms_norm bf16{' + residual' if residual else ''}{' offset' if offset else ''}",
                         "add_rms_norm_kernel", norm,
                         {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*fp32" if offset else "*bf16",
                          "sum_ptr": "*bf16", "out_ptr": "*bf16"},
                         dict(HAS_RESIDUAL=residual, HAS_OFFSET=offset, BLOCK=1024), residual and not offset)
           for residual in (True, False) for offset in (False, True)]
    out.append(KernelVariant("rotary bf16 d64", "rotary_kernel", "runtime.kernels.rotary",
                             {"x_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "out_ptr": "*bf16"},
                             dict(BLOCK_H=16, BLOCK_D=64), True))
    out += [KernelVariant(f"gated {name} bf16", "gated_activation_kernel", "runtime.kernels.gated_activation",
                          {"gate_ptr": "*bf16", "up_ptr": "*bf16", "out_ptr": "*bf16"},
                          dict(ACT=act, BLOCK_=1024, GELU_C_=0.7978845608028654), act == 0)
            for name, act in (("silu", 0), ("gelu_tanh", 1))]
    out.append(KernelVariant("merge splits bf16 d64", "merge_splits_kernel", "runtime.kernels.split_merge",
                             {"partial_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16"},
                             dict(NUM_SPLITS=8, BLOCK_S=8, BLOCK_D=64), True))
    return out


def variants() -> list[KernelVariant]:
    """Every kernel specialisation the wrappers launch, by family."""
    return (_int_variants() + _mid_variants() + _fp8_variants() + _attention_variants() + _store_variants()
            + _packed_variants() + _sink_variants() + _small_op_variants())


def kernel_names() -> dict[str, set[str]]:
    """{module: names of its top-level launched kernels} that the variants cover."""
    names: dict[str, set[str]] = {}
    for v in variants():
        names.setdefault(v.module, set()).add(v.kernel)
    return names


def compile_variant(variant: KernelVariant) -> dict:
    """Compile one variant for sm_90; return sizes and a few facts from the PTX."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(variant.module), variant.kernel)
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise KvslimError(f"{variant.kernel} is not a compilable JITFunction (is TRITON_INTERPRET set?)")
    signature = {}
    for arg in fn.arg_names:
        if arg in variant.constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = variant.pointers[arg]
        else:
            signature[arg] = "fp32" if arg in FLOAT_ARGS else "i32"
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(fn, signature, variant.constexprs), target=GPUTarget(*SM90),
                              options={"num_warps": variant.num_warps})
    ptx = compiled.asm["ptx"]
    return {
        "name": variant.name,
        "kernel": variant.kernel,
        "cubin_bytes": len(compiled.asm["cubin"]),
        "ptx_target": next((l.split()[1] for l in ptx.splitlines() if l.startswith(".target")), ""),
        "tensor_core": "mma" in ptx,
        "shared_bytes": int(compiled.metadata.shared),
        "num_warps": int(compiled.metadata.num_warps),
        **resource_usage(compiled.asm["cubin"]),
        "seconds": round(time.perf_counter() - start, 2),
    }


def resource_usage(cubin: bytes) -> dict:
    """Registers and spill stack per thread, from the cuobjdump that ships with Triton."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if not found:
        raise KvslimError(f"cuobjdump printed no resource usage: {text.strip()[:200]}")
    return {"registers": int(found.group(1)), "spill_stack_bytes": int(found.group(2))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="only the CI subset")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)", file=sys.stderr)
        return 2
    results = []
    for v in variants():
        if args.quick and not v.quick:
            continue
        r = compile_variant(v)
        results.append(r)
        print(f"{r['name']:<42} {r['kernel']:<26} {r['ptx_target']:<8} regs {r['registers']:>3}  stack {r['spill_stack_bytes']:>4} B  "
              f"smem {r['shared_bytes']:>6} B  mma={r['tensor_core']!s:<5} {r['seconds']:.1f}s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
