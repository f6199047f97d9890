"""How one packed cache group stores and reads its KV: the runtime's rules for its code widths
(``low_bit_kv``, each measured), or the variants of them a KV dtype name asks for
(``foundation.kv_dtype_mix.KV_VARIANTS``: ``int4:exact-first-block``...).

A model may retrieve best with other rules than the default model: Gemma-3-270M's int4 keeps a fact
stated once far better with its sinks' block exact, which SmolLM2's does not need. The checkpoint
names the variant in its ``plan.json`` and every engine built on it serves that.
"""
from __future__ import annotations

from dataclasses import dataclass

from foundation.errors import KvslimError
from runtime.cache import low_bit_kv
from runtime.cache.low_bit_kv import LOW_BIT_KV, PackedBits


@dataclass(frozen=True)
class PackedRecipe:
    """A packed group's storage rules."""

    bits: PackedBits
    keys_before_rope: bool  # keys stored before RoPE, rotated on every read (KVQuant)
    keys_rotated: bool  # keys (after RoPE) and queries in a rotated basis (kv_rotation)
    keys_clipped: bool  # key channel ranges clipped to least squared error (not in a first block)
    values_rotated: bool  # values in a rotated basis, attention outputs rotated back
    exact_first_block: bool  # a sequence's first block kept exact while it runs (full-attention groups)

    @classmethod
    def of(cls, bits: PackedBits, variants: tuple[str, ...] = ()) -> "PackedRecipe":
        """``bits``' default rules (``low_bit_kv``'s, read when called), changed by ``variants``."""
        before_rope = bits.keys in low_bit_kv.KEYS_BEFORE_ROPE_BITS and "keys-after-rope" not in variants
        clipped = bits.keys in low_bit_kv.CLIPPED_KEY_BITS or "keys-clipped" in variants
        exact_first = bool(bits.widths & low_bit_kv.EXACT_FIRST_BLOCK_BITS) or "exact-first-block" in variants
        return cls(
            bits,
            keys_before_rope=before_rope,
            keys_rotated=bits.keys in low_bit_kv.KEYS_ROTATED_BITS and not before_rope and "keys-unrotated" not in variants,
            keys_clipped=clipped and "keys-unclipped" not in variants,
            values_rotated=bits.values in low_bit_kv.VALUES_ROTATED_BITS and "values-unrotated" not in variants,
            exact_first_block=exact_first and "quantized-first-block" not in variants,
        )


def packed_recipes(dtypes: tuple[str, ...], variants: tuple[str, ...]) -> dict[str, PackedRecipe]:
    """Each packed dtype of ``dtypes`` -> its recipe with ``variants``; a one-line error for a variant
    that changes none of them (asked of unpacked KV, or already every packed part's rule)."""
    recipes = {d: PackedRecipe.of(LOW_BIT_KV[d], variants) for d in dtypes if d in LOW_BIT_KV}
    if variants and not recipes:
        raise KvslimError(f"KV variants ({'+'.join(variants)}) apply to packed KV ({', '.join(LOW_BIT_KV)}), "
                          f"not {'/'.join(dtypes)}")
    for v in variants:
        if all(PackedRecipe.of(r.bits, (v,)) == PackedRecipe.of(r.bits) for r in recipes.values()):
            raise KvslimError(f"KV variant {v} changes nothing for {'/'.join(recipes)} KV: it is stored so already")
    return recipes
