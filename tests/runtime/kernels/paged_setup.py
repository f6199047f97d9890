"""A small paged batch: sequences with random block tables, their K/V written through the
reference store, and a mix of decode, prefill and extend queries."""
from dataclasses import dataclass

import torch

from runtime.kernels.kv_store import reference_store_kv


@dataclass
class PagedBatch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor

    def args(self):
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens, self.query_start_loc)


def make_paged_batch(context_lens, query_lens, num_heads, num_kv_heads, head_dim, kv_dtype, scales,
                     block_size=4, q_dtype=torch.float32, device="cpu", seed=0) -> PagedBatch:
    """``scales``: None (unquantized), "token" (per token and head) or "scalar" (per layer)."""
    g = torch.Generator().manual_seed(seed)
    S = len(context_lens)
    max_blocks = max(-(-c // block_size) for c in context_lens)
    num_blocks = S * max_blocks + 3
    block_tables = torch.randperm(num_blocks, generator=g)[: S * max_blocks].reshape(S, max_blocks).int()
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    k_scale = v_scale = None
    if scales == "token":
        k_scale = torch.zeros(num_blocks, block_size, num_kv_heads)
        v_scale = torch.zeros_like(k_scale)
    elif scales == "scalar":
        k_scale, v_scale = torch.tensor(0.02), torch.tensor(0.03)
    T = sum(context_lens)
    k = torch.randn(T, num_kv_heads, head_dim, generator=g)
    v = torch.randn(T, num_kv_heads, head_dim, generator=g)
    slots = torch.cat([block_tables[s].long()[torch.arange(c) // block_size] * block_size + torch.arange(c) % block_size
                       for s, c in enumerate(context_lens)])
    reference_store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g).to(q_dtype)
    to = lambda t: None if t is None else t.to(device)
    return PagedBatch(to(q), to(k_cache), to(v_cache), to(k_scale), to(v_scale), to(block_tables),
                      to(torch.tensor(context_lens, dtype=torch.int32)), to(qsl))
