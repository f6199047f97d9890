"""ContiguousKVCache (the runtime core's AttentionBackend) against ``reference_attention``."""
from __future__ import annotations

import json

import pytest
import torch

from foundation.errors import KvslimError
from runtime.attention_backend import reference_attention
from runtime.contiguous_cache import ContiguousKVCache
from runtime.spec import ModelSpec

H, KVH, D = 4, 2, 32


def _spec(tiny_llama, **changes) -> ModelSpec:
    cfg = {**json.loads((tiny_llama / "config.json").read_text()), **changes}
    return ModelSpec.from_config(cfg)


@pytest.mark.parametrize("window", [None, 5])
def test_mixed_steps_match_reference(tiny_llama, window):
    """Three sequences at different stages (fresh prefill, chunk after a prefix, decode) in one
    flattened step; layer 1 reads layer 0's KV."""
    changes = {"kv_source_layers": [0, 0, 2, 3]}
    if window:
        changes.update(sliding_window=window, layer_types=["sliding_attention"] * 2 + ["full_attention"] * 2)
    spec = _spec(tiny_llama, **changes)
    cache = ContiguousKVCache(spec, torch.float32)
    g = torch.Generator().manual_seed(0)
    lengths = {0: 0, 1: 9, 2: 14}  # tokens already cached
    new = {0: 7, 1: 4, 2: 1}
    history = {s: (torch.randn(n, KVH, D, generator=g), torch.randn(n, KVH, D, generator=g)) for s, n in lengths.items()}
    for s, n in lengths.items():
        cache.add_sequence(s, n + new[s])
        if n:
            cache.begin_step([(s, n)])
            cache.attend(0, torch.zeros(n, H, D), *history[s])
    positions = cache.begin_step([(s, new[s]) for s in (0, 1, 2)])
    t = sum(new.values())
    assert positions.tolist() == list(range(0, 7)) + list(range(9, 13)) + [14]
    q0, q1 = torch.randn(t, H, D, generator=g), torch.randn(t, H, D, generator=g)
    k, v = torch.randn(t, KVH, D, generator=g), torch.randn(t, KVH, D, generator=g)
    out0 = cache.attend(0, q0, k, v)
    out1 = cache.attend(1, q1, None, None)  # reader: the owner's cache, written just above
    params = spec.attention_params(0)
    row = 0
    for s in (0, 1, 2):
        n, start = new[s], lengths[s]
        keys = torch.cat([history[s][0], k[row:row + n]])
        vals = torch.cat([history[s][1], v[row:row + n]])
        qpos, kpos = torch.arange(start, start + n), torch.arange(start + n)
        for q, out in ((q0, out0), (q1, out1)):
            ref = reference_attention(q[row:row + n], keys, vals, qpos, kpos, params.scale, window)
            torch.testing.assert_close(out[row:row + n], ref, atol=1e-5, rtol=1e-5)
        row += n


def test_softcap_path_matches_reference(tiny_llama):
    spec = _spec(tiny_llama)
    cache = ContiguousKVCache(spec, torch.float32)
    cache.params[0] = type(cache.params[0])(spec.attn_scale, None, 0, softcap=2.0)
    cache.add_sequence(0, 8)
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(8, H, D, generator=g), torch.randn(8, KVH, D, generator=g), torch.randn(8, KVH, D, generator=g)
    cache.begin_step([(0, 8)])
    pos = torch.arange(8)
    ref = reference_attention(q, k, v, pos, pos, spec.attn_scale, None, 2.0)
    torch.testing.assert_close(cache.attend(0, q, k, v), ref, atol=1e-5, rtol=1e-5)


def test_overflowing_the_reservation_is_refused(tiny_llama):
    cache = ContiguousKVCache(_spec(tiny_llama), torch.float32)
    cache.add_sequence(0, 4)
    with pytest.raises(KvslimError, match="exceed"):
        cache.begin_step([(0, 5)])
    with pytest.raises(KvslimError, match="already"):
        cache.add_sequence(0, 4)
    cache.free(0)
    assert cache.bytes_used() == 0
