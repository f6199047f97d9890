"""Calibrated FP8 KV-cache scales (``--kv-cache-fp8``), stored as compressed-tensors and vLLM read them.

Per layer: ``k_scale = max|K| / 448`` and ``v_scale = max|V| / 448`` over the calibration text,
where K are the keys *as they enter the cache* (after k_norm and rotary embedding) and V the
values; 448 is the largest float8_e4m3fn value. This is the min-max symmetric observer of
compressed-tensors (``scale = max(|min|, |max|) / ((q_max - q_min) / 2)``).

On disk (compressed-tensors 0.20 ``initialize_attn_qparams``; vLLM's
``CompressedTensorsKVCacheMethod`` accepts only ``strategy: "tensor"``):
- ``quantization_config.kv_cache_scheme = {"num_bits": 8, "type": "float", "strategy": "tensor",
  "symmetric": true, "dynamic": false, "group_size": null}``;
- ``<layer>.self_attn.k_scale`` / ``v_scale``: shape ``[1]``, in the model's dtype.
Per-head maxima are recorded too (``per_head``) for reports; the written scales are per layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

FP8_E4M3_MAX = 448.0
KV_CACHE_SCHEME = {
    "num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "tensor", "dynamic": False,
}


@dataclass
class KVScaleObserver:
    """Passed to decoder layers as their ``past_key_values``: sees every layer's cache writes.

    Implements the one method transformers' attention calls on a cache, ``update``, and returns
    the keys and values unchanged (nothing is cached).
    """

    k_amax: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [num_kv_heads]
    v_amax: dict[int, torch.Tensor] = field(default_factory=dict)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # [batch, kv_heads, seq, head_dim]
        for store, x in ((self.k_amax, key_states), (self.v_amax, value_states)):
            amax = x.detach().abs().amax(dim=(0, 2, 3)).to(torch.float32)
            store[layer_idx] = torch.maximum(store[layer_idx], amax) if layer_idx in store else amax
        return key_states, value_states

    def layers(self) -> list[int]:
        return sorted(self.k_amax)

    def scales(self, layer: int) -> tuple[float, float]:
        """``(k_scale, v_scale)`` of one layer."""
        return (float(self.k_amax[layer].max()) / FP8_E4M3_MAX, float(self.v_amax[layer].max()) / FP8_E4M3_MAX)

    def per_head(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_amax[layer] / FP8_E4M3_MAX, self.v_amax[layer] / FP8_E4M3_MAX


def kv_scale_tensors(observer: KVScaleObserver, attention_prefix: dict[int, str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``{"<layer>.self_attn.k_scale": tensor([s]), ...}`` for every observed layer.

    ``attention_prefix``: layer index -> the attention module's name (``model.layers.i.self_attn``).
    A layer that never wrote its cache (it reads another layer's) gets no scales.
    """
    out: dict[str, torch.Tensor] = {}
    for layer in observer.layers():
        k, v = observer.scales(layer)
        eps = torch.finfo(dtype).eps  # an all-zero cache would give a zero scale
        out[f"{attention_prefix[layer]}.k_scale"] = torch.tensor([max(k, eps)], dtype=dtype)
        out[f"{attention_prefix[layer]}.v_scale"] = torch.tensor([max(v, eps)], dtype=dtype)
    return out
