"""Paged KV cache: cache groups from an ``AttentionLayout``, tensors allocated per group.

A *cache group* gathers the cache-owning attention entries (layers, and the streaming heads of a
layer whose heads are split: ``AttentionLayout.entries``) that share (kind, window, sinks, kv heads, head
dim, KV dtype); its layers share one block table per sequence (the block manager keeps one pool per
group), and each layer has its own slot of tensors. Layers that read another layer's KV
(``kv_source != index``) map to the owner's (group, slot) and allocate nothing.

Layout per layer slot (shared with ``runtime/kernels``):
- ``k_cache``, ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the KV dtype
  (``float8_e4m3fn`` / ``int8`` for quantized KV);
- quantized KV adds ``k_scale``, ``v_scale``: ``[num_blocks, block_size, num_kv_heads]`` fp32
  (dynamic, per token and head), or 0-dim fp32 per-layer scalars from the checkpoint;
- ``int4`` / ``k4v2`` / ``k3v2`` / ``int2`` KV is packed instead (``runtime.cache.packed_layer``):
  codes, per-block key and per-token value parameters, and a few full-precision residual blocks
  for open blocks.
A token at logical position ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from foundation.attention_layout import AttentionLayout
from foundation.errors import KvslimError
from foundation.kv_dtype_mix import KvDtypeMix
from runtime.cache.compiled_kv_read import read_rows
from runtime.cache.kv_quant import QUANT_DTYPES
from runtime.cache.kv_rotation import KvRotation
from runtime.cache.low_bit_kv import LOW_BIT_KV, PARAM_DTYPE, PackedBits, bytes_per_token_head, packed_dim
from runtime.cache.packed_layer import PackedLayerCache
from runtime.cache.packed_recipe import PackedRecipe, packed_recipes
from runtime.cache.paged_rows import gather_blocks, store_rows
from runtime.cache.residual_slots import ResidualSlots
from runtime.cache.write_plan import WritePlan

KV_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    **QUANT_DTYPES,
}
CACHE_DTYPES = (*KV_DTYPES, *LOW_BIT_KV)  # every KV dtype the cache stores
SCALE_BYTES = 4  # fp32 per token and head
MIB = 1 << 20
RELEASED = -1  # block-table entry of a window block given back as the window slid past it


def available_memory_bytes() -> int | None:
    """Memory the OS can hand out without swapping (``MemAvailable``); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class CacheGroup:
    """Cache-owning attention entries with identical cache shape; ``layers[slot]`` is the entry
    (a layer's index, or a streaming part's) in that slot."""

    kind: Literal["full", "sliding"]
    window: int | None
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    layers: tuple[int, ...]
    sinks: int = 0  # sliding groups: the first ``sinks`` positions are never released
    recipe: PackedRecipe | None = None  # packed low-bit KV: how it is stored (its widths' rules, or a variant)

    @property
    def quantized(self) -> bool:
        return self.kv_dtype in QUANT_DTYPES

    @property
    def bits(self) -> PackedBits | None:
        """Key and value code widths of packed low-bit KV, else None."""
        return LOW_BIT_KV.get(self.kv_dtype)

    @property
    def exact_first_block(self) -> bool:
        """Whether each sequence's first block is also kept exact while it runs (``packed_layer``):
        full attention only, where a bf16 block is a small share of the context; a windowed group
        holds only its sinks' block and its window, which the bf16 block would outweigh."""
        return self.recipe is not None and self.recipe.exact_first_block and self.kind == "full"


def sink_block_count(sinks: int, block_size: int) -> int:
    """Leading blocks a sliding layer keeps for ``sinks`` attention sinks (the block holding
    positions ``0 .. sinks - 1``, whole): the one count the spec, the block manager and the
    attention plan share."""
    return -(-sinks // block_size)


@dataclass(frozen=True)
class KVCacheSpec:
    """Cache groups, the layer -> (group, slot) map, block size and scale mode."""

    groups: tuple[CacheGroup, ...]
    layer_slots: tuple[tuple[int, int], ...]  # per attention entry: (group index, slot in group)
    block_size: int
    static_scales: bool  # quantized KV with per-layer checkpoint scales (no per-token scales)
    entry_layers: tuple[int, ...]  # per attention entry: its model layer

    @classmethod
    def from_layout(
        cls, layout: AttentionLayout, kv_dtype: str, block_size: int = 16, static_scales: bool = False
    ) -> "KVCacheSpec":
        """``kv_dtype``: one cache dtype name, or ``FULL/WINDOWED``, with packed-KV variants after a colon
        (``foundation.kv_dtype_mix``)."""
        mix = KvDtypeMix.parse(kv_dtype, CACHE_DTYPES)
        recipes = packed_recipes(mix.dtypes, mix.variants)
        for name in mix.dtypes:
            if name in LOW_BIT_KV and any(layout.head_dim * b % 8 for b in LOW_BIT_KV[name].widths):
                raise KvslimError(f"{name} KV packs head_dim into bytes; head_dim {layout.head_dim} does not fit")
        if block_size < 1:
            raise KvslimError(f"block size must be positive, got {block_size}")
        if static_scales and (len(mix.dtypes) > 1 or mix.full not in QUANT_DTYPES):
            raise KvslimError(f"static KV scales need one quantized KV dtype, not {kv_dtype}")
        groups = tuple(CacheGroup(kind, window, kvh, layout.head_dim, mix.of(kind), layers=tuple(members), sinks=sinks,
                                  recipe=recipes.get(mix.of(kind)))
                       for (kind, window, sinks, kvh), members in layout.cache_groups().items())
        owner_slot = {layer: (g, s) for g, grp in enumerate(groups) for s, layer in enumerate(grp.layers)}
        slots = tuple(owner_slot[l.kv_source] for l in layout.entries)
        return cls(groups, slots, block_size, static_scales, layout.entry_layers)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def sinks(self) -> tuple[int, ...]:
        return tuple(g.sinks for g in self.groups)

    def sink_blocks(self, g: int) -> int:
        """Leading blocks group ``g`` keeps for its attention sinks."""
        return sink_block_count(self.groups[g].sinks, self.block_size)

    def scale_bytes(self, group: CacheGroup) -> int:
        """Bytes of scale per token and head (0 for unquantized or per-layer scalar scales)."""
        return SCALE_BYTES if group.quantized and not self.static_scales else 0

    def element_bytes(self, g: int) -> float:
        """Bytes per stored K or V element of group ``g``; packed low-bit KV counts its
        parameters in (``scale_bytes`` then adds nothing)."""
        grp = self.groups[g]
        if grp.bits:
            return bytes_per_token_head(grp.head_dim, grp.bits, self.block_size) / (2 * grp.head_dim)
        return torch.empty((), dtype=KV_DTYPES[grp.kv_dtype]).element_size()

    def kv_bytes_per_token(self, layout: AttentionLayout, context_len: int) -> float:
        """Average KV bytes per token of a ``context_len``-token sequence, by the layout's formula
        per group (each group in its own dtype, scales included; an exact first block in bf16)."""
        return sum(layout.kv_bytes_per_token(context_len, self.element_bytes(g), self.scale_bytes(grp), list(grp.layers))
                   + self.exact_block_bytes(g) / context_len
                   for g, grp in enumerate(self.groups))

    def exact_block_bytes(self, g: int, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of the exact first block one sequence keeps in group ``g`` (0 unless it keeps one)."""
        return self.residual_block_bytes(g, dtype) if self.groups[g].exact_first_block else 0

    @property
    def residual_blocks_per_seq(self) -> int:
        """Residual blocks one running sequence may hold: its open block, and its exact first block."""
        if not any(g.bits for g in self.groups):
            return 0
        return 2 if any(g.exact_first_block for g in self.groups) else 1

    def block_bytes(self, g: int) -> int:
        """Bytes one block of group ``g`` occupies over all its layers (K and V, with scales)."""
        grp = self.groups[g]
        per_token_head = grp.head_dim * self.element_bytes(g) + self.scale_bytes(grp)
        return round(2 * len(grp.layers) * self.block_size * grp.num_kv_heads * per_token_head)

    def residual_block_bytes(self, g: int, residual_dtype: torch.dtype) -> int:
        """Bytes of one full-precision residual block over group ``g``'s layers (low-bit KV only)."""
        grp = self.groups[g]
        if not grp.bits:
            return 0
        elem = torch.empty((), dtype=residual_dtype).element_size()
        return 2 * len(grp.layers) * self.block_size * grp.num_kv_heads * grp.head_dim * elem

    def max_blocks_per_seq(self, g: int, max_model_len: int) -> int:
        """Blocks one sequence of ``max_model_len`` tokens holds at once in group ``g`` (decoding)."""
        full = math.ceil(max_model_len / self.block_size)
        window = self.groups[g].window
        if window is None:
            return full
        # W live positions [p - W + 1, p] span at most this many blocks, wherever they start.
        return min(full, math.ceil((window + self.block_size - 1) / self.block_size) + self.sink_blocks(g))

    def blocks_in_flight(self, g: int, max_model_len: int, chunk: int) -> int:
        """Blocks one sequence may hold at once in group ``g`` while a prefill chunk of ``chunk``
        tokens is written: all of them (full attention), or a window plus the chunk (sliding)."""
        full = math.ceil(max_model_len / self.block_size)
        window = self.groups[g].window
        if window is None:
            return full
        return min(full, math.ceil((window + chunk + 2 * self.block_size) / self.block_size) + self.sink_blocks(g))

    def plan_num_blocks(self, budget_bytes: int, max_model_len: int,
                        min_blocks: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """Blocks per group for a byte budget, split so every group runs out at the same number
        of ``max_model_len`` sequences (sliding groups need only their window's blocks).
        ``min_blocks``: per group, blocks set aside first (a lone sequence's prefill), the rest
        split as above."""
        groups = range(len(self.groups))
        floor = min_blocks or (0,) * len(self.groups)
        budget_bytes -= sum(floor[g] * self.block_bytes(g) for g in groups)
        per_seq = [self.max_blocks_per_seq(g, max_model_len) for g in groups]
        # a sequence's exact first blocks live in residual slots, but the budget pays for them too
        seq_bytes = sum(n * self.block_bytes(g) + self.exact_block_bytes(g) for g, n in enumerate(per_seq))
        num_seqs = max(budget_bytes, 0) / seq_bytes
        return tuple(floor[g] + int(num_seqs * n) for g, n in enumerate(per_seq))

    def pool_for(self, budget_bytes: int, max_model_len: int, chunk: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(blocks per group for the budget, blocks one lone sequence needs in flight per group).
        Sliding groups reserve for decoding first; a lone sequence's prefill chunk needs more."""
        groups = range(len(self.groups))
        in_flight = tuple(self.blocks_in_flight(g, max_model_len, chunk) for g in groups)
        floor = tuple(max(0, need - self.max_blocks_per_seq(g, max_model_len)) for g, need in enumerate(in_flight))
        return self.plan_num_blocks(budget_bytes, max_model_len, floor), in_flight

    def fits(self, budget_bytes: int, max_model_len: int, chunk: int) -> bool:
        """Whether one sequence of ``max_model_len`` tokens fits a pool of ``budget_bytes``."""
        num_blocks, in_flight = self.pool_for(budget_bytes, max_model_len, chunk)
        return all(n >= need for n, need in zip(num_blocks, in_flight))

    def longest_fitting(self, budget_bytes: int, chunk: int, upper: int) -> int:
        """The longest ``max_model_len`` (<= ``upper``) one sequence of which fits the budget; 0: none."""
        lo, hi = 0, upper
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.fits(budget_bytes, mid, chunk) else (lo, mid - 1)
        return lo

    def smallest_budget(self, max_model_len: int, chunk: int) -> int:
        """The fewest bytes (to the MiB) a pool needs for one sequence of ``max_model_len`` tokens."""
        mib = 1 << 20
        lo, hi = 1, 1
        while not self.fits(hi * mib, max_model_len, chunk):
            lo, hi = hi + 1, hi * 2
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self.fits(mid * mib, max_model_len, chunk) else (mid + 1, hi)
        return lo * mib


@dataclass
class LayerCache:
    """One layer slot's tensors (views into its group's allocation)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


class KVCache:
    """The allocated paged tensors for a ``KVCacheSpec``; writes quantize, reads dequantize."""

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: tuple[int, ...],
        device: torch.device | str = "cpu",
        layer_scales: dict[int, tuple[float, float]] | None = None,
        residual_blocks: int = 0,
        residual_dtype: torch.dtype = torch.float32,
    ):
        """``residual_blocks``: full-precision blocks per low-bit layer for blocks being filled
        (at least the number of sequences that run at once); ``residual_dtype``: theirs."""
        if len(num_blocks) != len(spec.groups):
            raise KvslimError(f"{len(num_blocks)} block counts for {len(spec.groups)} cache groups")
        if spec.static_scales and layer_scales is None:
            raise KvslimError("static KV scales requested but no per-layer scales given")
        if residual_blocks < 1 and any(g.bits for g in spec.groups):
            raise KvslimError("low-bit KV needs full-precision residual blocks for the blocks being filled")
        self.spec = spec
        self.num_blocks = tuple(num_blocks)
        self.residual_blocks, self.residual_dtype = residual_blocks, residual_dtype
        # Refuse a budget that cannot fit, rather than die in the allocator (or be OOM-killed
        # while the zeros are written).
        nbytes = sum(n * spec.block_bytes(g) + residual_blocks * spec.residual_block_bytes(g, residual_dtype)
                     for g, n in enumerate(num_blocks))
        mib = round(nbytes / MIB)
        avail = available_memory_bytes() if torch.device(device).type == "cpu" else None
        if avail is not None and nbytes > avail:
            raise KvslimError(f"a KV cache of {mib} MiB does not fit in memory ({avail // MIB} MiB available)")
        self.device = torch.device(device)
        try:
            self._allocate(device)
        except RuntimeError as e:  # torch's allocators: "can't allocate memory" / "Tried to allocate"
            if "allocate" not in str(e):
                raise
            raise KvslimError(f"cannot allocate a KV cache of {mib} MiB on {device}: out of memory") from None
        # per low-bit group: one residual slot table for its layers; per group, per slot: the packed layer caches
        self.residual_slots: list[ResidualSlots | None] = [
            ResidualSlots(n, residual_blocks, self.device) if grp.bits else None
            for grp, n in zip(spec.groups, self.num_blocks)
        ]
        # per group whose values or keys are rotated: one basis for its layers, (values', keys')
        rotations = [self._rotations(grp.recipe, grp.head_dim) if grp.recipe else (None, None) for grp in spec.groups]
        self.packed: list[list[PackedLayerCache]] = [
            [PackedLayerCache({k: t[s] for k, t in self.tensors[g].items()}, grp.recipe, residual_dtype,
                              grp.exact_first_block, self.residual_slots[g], *rotations[g])
             for s in range(len(grp.layers))] if grp.bits else []
            for g, grp in enumerate(spec.groups)
        ]
        self.layers: list[LayerCache | PackedLayerCache] = []
        for layer, (g, s) in enumerate(spec.layer_slots):
            t = self.tensors[g]
            owner = spec.groups[g].layers[s]
            if spec.groups[g].bits:
                self.layers.append(self.packed[g][s])
                continue
            if spec.static_scales:
                ks, vs = layer_scales[spec.entry_layers[owner]]
                k_scale = torch.tensor(float(ks), dtype=torch.float32, device=device)
                v_scale = torch.tensor(float(vs), dtype=torch.float32, device=device)
            else:
                k_scale = t["k_scale"][s] if "k_scale" in t else None
                v_scale = t["v_scale"][s] if "v_scale" in t else None
            self.layers.append(LayerCache(t["k_cache"][s], t["v_cache"][s], k_scale, v_scale))

    def _allocate(self, device: torch.device | str) -> None:
        """Each group's zeroed K/V (and scale) tensors into ``self.tensors``."""
        spec = self.spec
        self.tensors: list[dict[str, torch.Tensor]] = []
        for grp, n in zip(spec.groups, self.num_blocks):
            shape = (len(grp.layers), n, spec.block_size, grp.num_kv_heads, grp.head_dim)
            if grp.bits:
                self.tensors.append(self._allocate_low_bit(grp, shape, device))
                continue
            t = {
                "k_cache": torch.zeros(shape, dtype=KV_DTYPES[grp.kv_dtype], device=device),
                "v_cache": torch.zeros(shape, dtype=KV_DTYPES[grp.kv_dtype], device=device),
            }
            if spec.scale_bytes(grp):
                t["k_scale"] = torch.ones(shape[:-1], dtype=torch.float32, device=device)
                t["v_scale"] = torch.ones(shape[:-1], dtype=torch.float32, device=device)
            self.tensors.append(t)

    def _allocate_low_bit(self, grp: CacheGroup, shape: tuple[int, ...], device) -> dict[str, torch.Tensor]:
        layers, n, bs, kvh, d = shape
        residual = (layers, self.residual_blocks, bs, kvh, d)
        k_codes, v_codes = ((layers, n, bs, kvh, packed_dim(d, bits)) for bits in (grp.bits.keys, grp.bits.values))
        return {
            "k_codes": torch.zeros(k_codes, dtype=torch.uint8, device=device),
            "v_codes": torch.zeros(v_codes, dtype=torch.uint8, device=device),
            "k_scale": torch.ones((layers, n, kvh, d), dtype=PARAM_DTYPE, device=device),
            "k_min": torch.zeros((layers, n, kvh, d), dtype=PARAM_DTYPE, device=device),
            "v_scale": torch.ones((layers, n, bs, kvh), dtype=PARAM_DTYPE, device=device),
            "v_min": torch.zeros((layers, n, bs, kvh), dtype=PARAM_DTYPE, device=device),
            "k_residual": torch.zeros(residual, dtype=self.residual_dtype, device=device),
            "v_residual": torch.zeros(residual, dtype=self.residual_dtype, device=device),
        }

    def release_block(self, g: int, block: int) -> None:
        """The block manager freed ``block`` of group ``g``: an open low-bit block gives back its
        residual slot (the group's, for all its layers)."""
        if self.residual_slots[g] is not None:
            self.residual_slots[g].release((block,))

    def plan_packed_writes(self, write_plan: Callable[[int, bool], WritePlan]) -> dict[int, WritePlan]:
        """One step's packed writes, once per low-bit group: ``write_plan(g, exact_first_block)``
        (the batch's) with its slots applied to the group's table, for every layer of the group."""
        return {g: slots.apply(write_plan(g, self.spec.groups[g].exact_first_block))
                for g, slots in enumerate(self.residual_slots) if slots is not None}

    def is_packed(self, layer: int) -> bool:
        """Whether ``layer``'s cache is packed low-bit KV (quantized a block at a time)."""
        return isinstance(self.layers[layer], PackedLayerCache)

    def is_quantized(self, layer: int) -> bool:
        """Whether ``layer``'s cache quantizes what it stores (FP8/INT8 scales, or packed low-bit KV):
        a step then reads its own new rows exact, not back from the cache."""
        lc = self.layers[layer]
        return isinstance(lc, PackedLayerCache) or lc.k_scale is not None

    def keys_before_rope(self, layer: int) -> bool:
        """Whether ``layer``'s cache stores keys before RoPE (rotated on read; 2- and 3-bit keys)."""
        lc = self.layers[layer]
        return isinstance(lc, PackedLayerCache) and lc.keys_before_rope

    def _rotations(self, recipe: PackedRecipe, head_dim: int) -> tuple[KvRotation | None, KvRotation | None]:
        """A packed group's value and key bases (``PackedRecipe.values_rotated``, ``keys_rotated``): one
        shared basis, or None for a part kept as it is."""
        values, keys = recipe.values_rotated, recipe.keys_rotated
        basis = KvRotation(head_dim, self.device) if values or keys else None
        return (basis if values else None), (basis if keys else None)

    def value_rotation(self, layer: int) -> KvRotation | None:
        """The basis ``layer``'s cache keeps values in (2-bit values), or None: values as they are."""
        lc = self.layers[layer]
        return lc.value_rotation if isinstance(lc, PackedLayerCache) else None

    def key_rotation(self, layer: int) -> KvRotation | None:
        """The basis ``layer``'s cache keeps keys (after RoPE) and reads queries in (4-bit keys), or None."""
        lc = self.layers[layer]
        return lc.key_rotation if isinstance(lc, PackedLayerCache) else None

    def stores_exactly(self, layer: int, dtype: torch.dtype) -> bool:
        """Whether ``layer``'s cache keeps K/V of ``dtype`` unchanged (no quantization, same dtype)."""
        lc = self.layers[layer]
        return isinstance(lc, LayerCache) and lc.k_scale is None and lc.k_cache.dtype == dtype

    def group_nbytes(self, g: int) -> int:
        """Bytes actually allocated for group ``g`` (counted from the tensors)."""
        return sum(t.numel() * t.element_size() for t in self.tensors[g].values())

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              plan: WritePlan | None = None) -> None:
        """Store new ``k``, ``v`` ``[T, kvh, D]`` at ``slot_mapping [T]``, quantizing on write
        (``plan``: a packed layer's write plan for these slots, the step's)."""
        lc = self.layers[layer]
        if isinstance(lc, PackedLayerCache):
            lc.write(k, v, slot_mapping, plan)
            return
        store_rows(lc.k_cache, lc.k_scale, k, slot_mapping)
        store_rows(lc.v_cache, lc.v_scale, v, slot_mapping)

    def gather(self, layer: int, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``blocks [..., nb]`` (physical ids) -> ``[..., nb * block_size, kvh, D]``."""
        lc = self.layers[layer]
        if isinstance(lc, PackedLayerCache):
            return lc.gather(blocks, dtype)
        if lc.k_scale is None:  # bf16 rows: one gather either way
            return gather_blocks(lc.k_cache, None, blocks, dtype), gather_blocks(lc.v_cache, None, blocks, dtype)
        return read_rows(lc.k_cache, lc.k_scale, blocks, dtype), read_rows(lc.v_cache, lc.v_scale, blocks, dtype)
