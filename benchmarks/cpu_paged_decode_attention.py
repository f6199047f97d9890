"""One layer's decode attention over the paged KV cache on the CPU: gather + SDPA against reading blocks in place.

The engine's CPU path (``runtime.attention.paged``) gathers each sequence's blocks into one padded
tensor (``index_select``) and runs torch's SDPA over it. The only torch op that reads a paged cache
in place on the CPU is FlexAttention (inductor's C++ template) with a ``BlockMask`` whose KV indices
are the physical blocks, as torch's experimental ``PagedAttention`` builds them. Rows, per batch size
(one new token per sequence, the default model's 9 query / 3 KV heads of 64, bf16, 16-token blocks
scattered over a 4,096-block cache):

- **gather + SDPA**: ``gather_blocks`` for K and V, then SDPA with the KV heads' query rows grouped, as
  the engine decodes;
- **SDPA alone**: the same SDPA over K/V already gathered (what a gather-free kernel could reach at best
  with torch's SDPA);
- **FlexAttention, blocks in place**: ``torch.compile(flex_attention)`` (static shapes), no gather.

Every output is checked against the plain-torch ``reference_attention`` first (max |diff| <= 2e-2).

    python benchmarks/cpu_paged_decode_attention.py --json benchmarks/results/cpu_paged_decode_attention.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a script

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 9, 3, 64, 16, 4096
MAX_ERR = 2e-2  # fixed before measuring: bf16 outputs against the fp32 reference, absolute


def ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def case(seqs: int, context: int, reps: int) -> dict:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    from runtime.attention.backend import reference_attention
    from runtime.cache.paged_rows import gather_blocks

    g = torch.Generator().manual_seed(seqs)
    dt, scale = torch.bfloat16, HEAD_DIM**-0.5
    ctx = torch.randint(context - BLOCK, context + 1, (seqs,), generator=g)
    nbs = (ctx + BLOCK - 1) // BLOCK
    width = int(nbs.max())
    order = torch.randperm(NUM_BLOCKS, generator=g)
    table = torch.zeros(seqs, width, dtype=torch.long)
    used = 0
    for i, n in enumerate(nbs.tolist()):
        table[i, :n] = order[used:used + n]
        used += n
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dt)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dt)
    q = torch.randn(seqs, HEADS, HEAD_DIM, generator=g).to(dt)
    key_pos = torch.arange(width * BLOCK)
    bias = torch.zeros(seqs, width * BLOCK, dtype=dt).masked_fill_(key_pos >= ctx[:, None], float("-inf"))[:, None, None]
    rep = HEADS // KV_HEADS

    def sdpa(kk: torch.Tensor, vv: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q.view(seqs, KV_HEADS, rep, HEAD_DIM), kk.transpose(1, 2),
                                              vv.transpose(1, 2), attn_mask=bias, scale=scale).reshape(q.shape)

    def gathered() -> tuple[torch.Tensor, torch.Tensor]:
        return gather_blocks(k_cache, None, table, dt), gather_blocks(v_cache, None, table, dt)

    kk, vv = gathered()

    # FlexAttention over the whole cache as one sequence of NUM_BLOCKS * BLOCK keys: each query's full
    # blocks, then its last (partial) block masked by logical position.
    logical_of = torch.full((seqs, NUM_BLOCKS), -1, dtype=torch.int32)
    for i, n in enumerate(nbs.tolist()):
        logical_of[i, table[i, :n]] = torch.arange(n, dtype=torch.int32)
    ctx32 = ctx.to(torch.int32)

    def mask_mod(b, h, q_idx, kv_idx):
        pos = logical_of[b, kv_idx // BLOCK] * BLOCK + kv_idx % BLOCK
        return (pos >= 0) & (pos < ctx32[b])

    full_idx = torch.zeros(seqs, 1, 1, NUM_BLOCKS, dtype=torch.int32)
    last_idx = torch.zeros(seqs, 1, 1, NUM_BLOCKS, dtype=torch.int32)
    for i, n in enumerate(nbs.tolist()):
        full_idx[i, 0, 0, :n - 1] = table[i, :n - 1].int()
        last_idx[i, 0, 0, 0] = int(table[i, n - 1])
    # Full blocks are passed explicitly: with none, torch 2.13's CPU template does not compile.
    mask = BlockMask.from_kv_blocks(torch.ones(seqs, 1, 1, dtype=torch.int32), last_idx,
                                    (nbs - 1).int().view(seqs, 1, 1), full_idx, BLOCK_SIZE=(1, BLOCK),
                                    mask_mod=mask_mod, seq_lengths=(1, NUM_BLOCKS * BLOCK))
    k_flat = k_cache.view(1, NUM_BLOCKS * BLOCK, KV_HEADS, HEAD_DIM).transpose(1, 2)
    v_flat = v_cache.view(1, NUM_BLOCKS * BLOCK, KV_HEADS, HEAD_DIM).transpose(1, 2)
    flex = torch.compile(flex_attention, dynamic=False)

    def flex_in_place() -> torch.Tensor:
        out = flex(q.view(seqs, HEADS, 1, HEAD_DIM), k_flat, v_flat, block_mask=mask, scale=scale, enable_gqa=True)
        return out.view(q.shape)

    rows = {}
    for name, fn in (("gather + SDPA", lambda: sdpa(*gathered())), ("SDPA alone", lambda: sdpa(kk, vv)),
                     ("FlexAttention, blocks in place", flex_in_place)):
        out = fn()
        err = max((out[i].float() - reference_attention(
            q[i:i + 1], kk[i, :int(ctx[i])], vv[i, :int(ctx[i])], ctx[i:i + 1] - 1, torch.arange(int(ctx[i])), scale,
        )[0].float()).abs().max().item() for i in range(seqs))
        if err > MAX_ERR:
            raise SystemExit(f"{name} at {seqs} sequences: max |diff| {err:.3g} > {MAX_ERR}")
        rows[name] = {"ms": ms(fn, reps), "max_abs_diff": err}
    return {"seqs": seqs, "context": context, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=256, help="tokens per sequence (the last block partly filled)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from engine_throughput import cpu_flags  # a sibling script

    with torch.inference_mode():
        cases = [case(s, args.context, args.reps) for s in args.seqs]
    names = list(cases[0]["rows"])
    print(f"\none layer's decode attention, {HEADS} q / {KV_HEADS} KV heads of {HEAD_DIM}, bf16, ~{args.context} "
          f"tokens per sequence, {args.threads} threads ({platform.processor() or platform.machine()}; CPU flags: "
          f"{cpu_flags()}); ms per call")
    print(f"{'sequences':>9s} " + " ".join(f"{n:>32s}" for n in names))
    for c in cases:
        print(f"{c['seqs']:9d} " + " ".join(f"{c['rows'][n]['ms']:32.3f}" for n in names))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": args.threads, "cpu_flags": cpu_flags(), "cases": cases}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
