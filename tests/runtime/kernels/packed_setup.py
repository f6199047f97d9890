"""A small packed low-bit layer (the engine's own ``KVCache`` allocation) and a batch of
sequences written into it in position order, their last blocks left open where the context
does not fill them."""
from dataclasses import dataclass

import torch

from foundation.attention_layout import AttentionLayout
from runtime.cache.kv_cache import KVCache, KVCacheSpec
from runtime.cache.packed_layer import PackedLayerCache
from runtime.kernels.packed_kv_store import reference_store_packed_kv

KV_DTYPE = {4: "int4", 2: "int2"}


def kv_dtype(bits: int | str) -> str:
    """``4`` / ``2``: int4 / int2 (keys and values at those bits); a name (``k4v2``) as it is."""
    return KV_DTYPE.get(bits, bits)


def packed_layer(bits: int | str, block_size: int = 4, kv_heads: int = 2, head_dim: int = 16, num_blocks: int = 16,
                 residual_blocks: int = 6, device="cpu") -> PackedLayerCache:
    """One layer's packed cache; fp32 residual (the interpreter's fp32 -> bf16 cast truncates)."""
    config = dict(num_hidden_layers=1, num_attention_heads=kv_heads, num_key_value_heads=kv_heads,
                  hidden_size=kv_heads * head_dim, head_dim=head_dim)
    spec = KVCacheSpec.from_layout(AttentionLayout.from_config(config), kv_dtype(bits), block_size)
    return KVCache(spec, (num_blocks,), device=device, residual_blocks=residual_blocks).layers[0]


@dataclass
class PackedBatch:
    q: torch.Tensor
    cache: PackedLayerCache
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    k: list[torch.Tensor]  # per sequence, the exact K/V written ([ctx, KVH, D])
    v: list[torch.Tensor]
    k_new: torch.Tensor  # the last step's rows ([T, KVH, D], with q)
    v_new: torch.Tensor

    def args(self):
        """``packed_paged_attention``'s positional arguments up to the scale."""
        return (self.q, self.k_new, self.v_new, self.cache, self.block_tables, self.context_lens, self.query_start_loc)


def make_packed_batch(context_lens, query_lens, num_heads, num_kv_heads, head_dim, bits, block_size=4,
                      device="cpu", seed=0, store=reference_store_packed_kv) -> PackedBatch:
    """Sequences with random block tables, each written in two steps (its cached prefix, then its
    ``query_lens`` new tokens) through ``store``; queries for the new tokens, whose K/V are the
    second step's."""
    g = torch.Generator().manual_seed(seed)
    S = len(context_lens)
    max_blocks = max(-(-c // block_size) for c in context_lens)
    num_blocks = S * max_blocks + 3
    cache = packed_layer(bits, block_size, num_kv_heads, head_dim, num_blocks, residual_blocks=num_blocks, device=device)
    block_tables = torch.randperm(num_blocks, generator=g)[: S * max_blocks].reshape(S, max_blocks).int()
    ks, vs = [], []
    for s, c in enumerate(context_lens):
        k = torch.randn(c, num_kv_heads, head_dim, generator=g)
        k[:, :, 1] *= 20.0  # an outlier channel, as keys have
        ks.append(k)
        vs.append(torch.randn(c, num_kv_heads, head_dim, generator=g))
    slots = [block_tables[s].long()[torch.arange(c) // block_size] * block_size + torch.arange(c) % block_size
             for s, c in enumerate(context_lens)]
    for part in (lambda s: slice(0, context_lens[s] - query_lens[s]), lambda s: slice(context_lens[s] - query_lens[s], None)):
        idx = [part(s) for s in range(S)]
        k = torch.cat([ks[s][idx[s]] for s in range(S)]).to(device)
        v = torch.cat([vs[s][idx[s]] for s in range(S)]).to(device)
        store(k, v, cache, torch.cat([slots[s][idx[s]] for s in range(S)]).to(device))
    k_new, v_new = k, v
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=g)
    return PackedBatch(q.to(device), cache, block_tables.to(device), torch.tensor(context_lens, dtype=torch.int32, device=device),
                       qsl.to(device), ks, vs, k_new, v_new)
