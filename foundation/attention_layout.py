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
- ``streaming_heads``: ``{"window": W, "sinks": S, "kv_heads": [[h, ...] per layer]}`` (written by
  ``compress convert --streaming-heads``, DuoAttention's streaming heads): in layer ``l`` the KV
  heads listed (and their query heads) attend to the first S and the last W tokens only; the
  other heads attend to everything. The weights stay as they are.

*Attention entries*: the runtime caches per entry, one per layer plus one per layer whose heads
are split between full and streaming. Entry ``l`` is layer ``l`` (its full heads, or all its heads
when they all stream); the streaming heads of split layers follow as entries ``L, L + 1, ...`` in
layer order. Each entry is a ``LayerAttention`` of its own (kind, window, sinks, KV heads).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal

from foundation.errors import KvslimError

KV_SOURCE_KEY = "kv_source_layers"
SINKS_KEY = "num_sink_tokens"
STREAMING_KEY = "streaming_heads"
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
    streaming: "StreamingHeads | None" = None  # full layers: the KV heads that stream

    def cached_tokens(self, context_len: int) -> int:
        """Tokens of a ``context_len``-token sequence this layer's cache must hold."""
        if self.kind == "full":
            return context_len
        return min(context_len, self.window + self.sinks)


@dataclass(frozen=True)
class StreamingHeads:
    """The KV heads ``heads`` of a full layer attend to ``sinks`` + ``window`` tokens only."""

    heads: tuple[int, ...]
    window: int
    sinks: int

    @property
    def num_kv_heads(self) -> int:
        return len(self.heads)


@dataclass(frozen=True)
class EntryPart:
    """Which KV heads of a layer attention entry ``entry`` covers (ascending)."""

    entry: int
    heads: tuple[int, ...]


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

    def streaming_layers(self) -> list[int]:
        """Layers with streaming heads."""
        return [i for i, l in enumerate(self.layers) if l.streaming is not None]

    @property
    def num_streaming_kv_heads(self) -> int:
        return sum(l.streaming.num_kv_heads for l in self.layers if l.streaming is not None)

    @cached_property
    def entries(self) -> tuple[LayerAttention, ...]:
        """The attention entries (see the module docstring): each owns its KV unless it reads a
        layer that does; streaming parts own theirs."""
        own, extra = [], []
        for i, l in enumerate(self.layers):
            s = l.streaming
            if s is None:
                own.append(l)
                continue
            stream = LayerAttention("sliding", s.window, s.num_kv_heads, i, s.sinks)
            if s.num_kv_heads == l.num_kv_heads:
                own.append(stream)
                continue
            own.append(LayerAttention("full", None, l.num_kv_heads - s.num_kv_heads, i))
            extra.append(stream)
        n = len(own)
        return (*own, *(replace(e, kv_source=n + j) for j, e in enumerate(extra)))

    @cached_property
    def entry_parts(self) -> tuple[tuple[EntryPart, ...], ...]:
        """Per layer, its entries and the KV heads each covers (one part, or full then streaming)."""
        out, extra = [], len(self.layers)
        for i, l in enumerate(self.layers):
            s = l.streaming
            every = tuple(range(l.num_kv_heads))
            if s is None or s.num_kv_heads == l.num_kv_heads:
                out.append((EntryPart(i, every),))
                continue
            full = tuple(h for h in every if h not in s.heads)
            out.append((EntryPart(i, full), EntryPart(extra, s.heads)))
            extra += 1
        return tuple(out)

    @cached_property
    def entry_layers(self) -> tuple[int, ...]:
        """The model layer of each attention entry."""
        by_entry = {p.entry: i for i, parts in enumerate(self.entry_parts) for p in parts}
        return tuple(by_entry[e] for e in range(len(by_entry)))

    def cache_groups(self) -> dict[tuple[str, int | None, int, int], list[int]]:
        """The cache-owning entries by (kind, window, sinks, KV heads), the runtime's cache groups
        for one KV dtype, in first-seen order."""
        groups: dict[tuple[str, int | None, int, int], list[int]] = {}
        entries = self.entries
        for e in self.cache_owner_entries():
            l = entries[e]
            groups.setdefault((l.kind, l.window, l.sinks, l.num_kv_heads), []).append(e)
        return groups

    def cache_owner_entries(self) -> list[int]:
        """Attention entries that store their own K/V."""
        return [e for e, l in enumerate(self.entries) if l.kv_source == e]

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
        return cls(n_heads, head_dim, _with_streaming(tuple(layers), config.get(STREAMING_KEY)))

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
        streams = {(l.streaming.window, l.streaming.sinks) for l in self.layers if l.streaming is not None}
        if len(streams) > 1:
            raise KvslimError(f"configs hold one window and sink count for all streaming heads ({STREAMING_KEY})")
        if streams:
            window, sinks = streams.pop()
            heads = [list(l.streaming.heads) if l.streaming else [] for l in self.layers]
            updates[STREAMING_KEY] = {"window": window, "sinks": sinks, "kv_heads": heads}
        return updates

    # --- the KV-bytes-per-token formula ------------------------------------------------------
    def kv_bytes(self, context_len: int, dtype_bytes: float, scale_bytes: float = 0.0,
                 entries: list[int] | None = None) -> float:
        """KV cache bytes one sequence of ``context_len`` tokens holds.

        Sum over cache-owning attention entries (layers, and streaming heads apart) of
        ``2 * num_kv_heads * (head_dim * dtype_bytes + scale_bytes) * tokens``, where ``tokens`` is
        ``context_len`` for full layers and ``min(context_len, window + sinks)`` for sliding ones and
        streaming heads. ``scale_bytes`` is per token and head (4 for fp32 per-token scales, 0 for
        bf16 or per-layer scalar scales). Layers that read another layer's KV add nothing.
        ``entries``: only these (one cache group's), default every owner.
        """
        all_entries = self.entries
        total = 0.0
        for e in self.cache_owner_entries() if entries is None else entries:
            l = all_entries[e]
            total += 2 * l.num_kv_heads * (self.head_dim * dtype_bytes + scale_bytes) * l.cached_tokens(context_len)
        return total

    def kv_bytes_per_token(self, context_len: int, dtype_bytes: float, scale_bytes: float = 0.0,
                           entries: list[int] | None = None) -> float:
        """Average KV bytes per token at ``context_len`` (sliding layers amortised over it)."""
        return self.kv_bytes(context_len, dtype_bytes, scale_bytes, entries) / context_len


def _with_streaming(layers: tuple[LayerAttention, ...], value) -> tuple[LayerAttention, ...]:
    """``layers`` with the ``streaming_heads`` config entry applied (validated, one line per fault)."""
    if value is None:
        return layers
    where = f"config {STREAMING_KEY}"
    if not isinstance(value, dict) or set(value) != {"window", "sinks", "kv_heads"}:
        raise KvslimError(f"{where} must be {{'window': W, 'sinks': S, 'kv_heads': [[head, ...] per layer]}}")
    window, sinks, heads = value["window"], value["sinks"], value["kv_heads"]
    if not isinstance(window, int) or window < 1 or not isinstance(sinks, int) or sinks < 0:
        raise KvslimError(f"{where}: window {window!r} must be a positive and sinks {sinks!r} a non-negative integer")
    if not isinstance(heads, list) or len(heads) != len(layers):
        raise KvslimError(f"{where}: kv_heads needs one list of heads per layer ({len(layers)})")
    readers = {l.kv_source for i, l in enumerate(layers) if l.kv_source != i}
    out = []
    for i, (l, hs) in enumerate(zip(layers, heads)):
        ok = isinstance(hs, list) and all(isinstance(h, int) and 0 <= h < l.num_kv_heads for h in hs)
        if not ok or len(set(hs)) != len(hs):
            raise KvslimError(f"{where}: kv_heads[{i}]={hs!r} must list distinct KV heads of the layer's "
                              f"{l.num_kv_heads}")
        if hs and (l.kind != "full" or l.kv_source != i or i in readers):
            raise KvslimError(f"{where}: layer {i} is sliding or shares its KV; streaming heads need a full layer "
                              "that owns its cache")
        out.append(replace(l, streaming=StreamingHeads(tuple(sorted(hs)), window, sinks)) if hs else l)
    return tuple(out)
