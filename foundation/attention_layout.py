"""AttentionLayout: per-layer attention shape, read from and written to HF config keys.

Config keys (the shared definitions every stage uses):
- ``num_key_value_heads``: KV heads per layer (MQA = 1).
- ``sliding_window`` + ``layer_types`` (``"sliding_attention"`` / ``"full_attention"``).
  Window convention (as transformers masks it): with window W, the query at position i attends
  keys j with i - W < j <= i, i.e. itself and the W - 1 tokens before it. A sliding layer's cache
  therefore needs at most W tokens per sequence.
- ``num_sink_tokens`` S (kvslim's key, written by ``compress convert --sinks``): sliding layers
  also attend to the first S tokens of the sequence (StreamingLLM's attention sinks), at their
  original positions; such a layer's cache holds at most S + W tokens per sequence.
- ``kv_source_layers``: a list, one entry per layer, the index of the layer whose K/V this layer
  reads (equal to its own index when it computes and caches its own). Written by
  ``compress convert --kv-share``; absent means every layer owns its cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from foundation.errors import KvslimError

KV_SOURCE_KEY = "kv_source_layers"
SINKS_KEY = "num_sink_tokens"
SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention: full or sliding (with its window), KV heads, and whose KV it reads."""

    kind: Literal["full", "sliding"]
    window: int | None
    num_kv_heads: int
    kv_source: int
    sinks: int = 0  # sliding layers: the first ``sinks`` tokens stay visible to every query

    def cached_tokens(self, context_len: int) -> int:
        """Tokens of a ``context_len``-token sequence this layer's cache must hold."""
        if self.kind == "full":
            return context_len
        return min(context_len, self.window + self.sinks)


@dataclass(frozen=True)
class AttentionLayout:
    num_heads: int
    head_dim: int
    layers: tuple[LayerAttention, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].num_kv_heads

    def cache_owners(self) -> list[int]:
        """Layers that compute and store their own K/V."""
        return [i for i, l in enumerate(self.layers) if l.kv_source == i]

    def sliding_layers(self) -> list[int]:
        return [i for i, l in enumerate(self.layers) if l.kind == "sliding"]

    @classmethod
    def from_config(cls, config: dict) -> "AttentionLayout":
        n_layers = int(config["num_hidden_layers"])
        n_heads = int(config["num_attention_heads"])
        n_kv = int(config.get("num_key_value_heads") or n_heads)
        head_dim = int(config.get("head_dim") or config["hidden_size"] // n_heads)
        window = config.get("sliding_window")
        sinks = config.get(SINKS_KEY) or 0
        if not isinstance(sinks, int) or sinks < 0:
            raise KvslimError(f"config {SINKS_KEY}={sinks!r} must be a non-negative integer")
        types = config.get("layer_types")
        if types is None:
            # Mistral-style: a sliding_window alone applies to every layer; Qwen2 gates it.
            uses_window = window is not None and config.get("use_sliding_window", True)
            if config.get("model_type") == "qwen2" and uses_window:
                start = int(config.get("max_window_layers", n_layers))
                types = [FULL if i < start else SLIDING for i in range(n_layers)]
            else:
                types = [SLIDING if uses_window else FULL] * n_layers
        if len(types) != n_layers:
            raise KvslimError(f"config layer_types has {len(types)} entries for {n_layers} layers")
        sources = config.get(KV_SOURCE_KEY) or list(range(n_layers))
        if len(sources) != n_layers:
            raise KvslimError(f"config {KV_SOURCE_KEY} has {len(sources)} entries for {n_layers} layers")
        layers = []
        for i, (t, src) in enumerate(zip(types, sources)):
            if t not in (FULL, SLIDING):
                raise KvslimError(f"config layer_types[{i}]={t!r} is not {FULL!r} or {SLIDING!r}")
            if not 0 <= src <= i or sources[src] != src:
                raise KvslimError(f"config {KV_SOURCE_KEY}[{i}]={src}: must name an earlier layer that owns its cache")
            sliding = t == SLIDING
            if sliding and window is None:
                raise KvslimError(f"layer {i} is sliding but config has no sliding_window")
            layers.append(LayerAttention("sliding" if sliding else "full", int(window) if sliding else None, n_kv,
                                         int(src), sinks if sliding else 0))
        if sinks and not any(l.kind == "sliding" for l in layers):
            raise KvslimError(f"config {SINKS_KEY}={sinks} but no layer is sliding")
        for i, l in enumerate(layers):
            owner = layers[l.kv_source]
            if (owner.kind, owner.window, owner.sinks) != (l.kind, l.window, l.sinks):
                raise KvslimError(f"layer {i} reads layer {l.kv_source}'s KV but their windows differ")
        return cls(n_heads, head_dim, tuple(layers))

    def config_updates(self) -> dict:
        """The config keys that describe this layout (merge into config.json)."""
        updates: dict = {"num_key_value_heads": self.num_kv_heads}
        windows = {l.window for l in self.layers if l.kind == "sliding"}
        if windows:
            if len(windows) > 1:
                raise KvslimError("HF configs hold one sliding_window for all sliding layers")
            updates["sliding_window"] = windows.pop()
            updates["layer_types"] = [SLIDING if l.kind == "sliding" else FULL for l in self.layers]
            sinks = {l.sinks for l in self.layers if l.kind == "sliding"}
            if len(sinks) > 1:
                raise KvslimError(f"configs hold one {SINKS_KEY} for all sliding layers")
            if sinks != {0}:
                updates[SINKS_KEY] = sinks.pop()
        sources = [l.kv_source for l in self.layers]
        if sources != list(range(self.num_layers)):
            updates[KV_SOURCE_KEY] = sources
        return updates

    # --- the KV-bytes-per-token formula ------------------------------------------------------
    def kv_bytes(self, context_len: int, dtype_bytes: float, scale_bytes: float = 0.0) -> float:
        """KV cache bytes one sequence of ``context_len`` tokens holds.

        Sum over cache-owning layers of ``2 * num_kv_heads * (head_dim * dtype_bytes +
        scale_bytes) * tokens``, where ``tokens`` is ``context_len`` for full layers and
        ``min(context_len, window + sinks)`` for sliding ones. ``scale_bytes`` is per token and head (4 for
        fp32 per-token scales, 0 for bf16 or per-layer scalar scales). Layers that read another
        layer's KV add nothing.
        """
        total = 0.0
        for i in self.cache_owners():
            l = self.layers[i]
            total += 2 * l.num_kv_heads * (self.head_dim * dtype_bytes + scale_bytes) * l.cached_tokens(context_len)
        return total

    def kv_bytes_per_token(self, context_len: int, dtype_bytes: float, scale_bytes: float = 0.0) -> float:
        """Average KV bytes per token at ``context_len`` (sliding layers amortised over it)."""
        return self.kv_bytes(context_len, dtype_bytes, scale_bytes) / context_len
