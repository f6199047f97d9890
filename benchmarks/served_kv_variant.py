"""A served KV dtype, or a variant of one that the runtime does not default to (``DTYPE:HOW``).

``int2:quantized-first-block`` / ``int4:exact-first-block``: int2 without (int4 with) each
sequence's first block kept exact (``low_bit_kv.EXACT_FIRST_BLOCK_BITS``, the runtime's default).
``k3v2:keys-after-rope`` / ``k3v2:keys-clipped``: 3-bit keys stored after RoPE (not before,
``KEYS_BEFORE_ROPE_BITS``), or with their channel ranges clipped as well (``CLIPPED_KEY_BITS``).
``int4:keys-unrotated`` / ``k4v2:keys-unrotated``: 4-bit keys in the model's basis, not a rotated one
(``KEYS_ROTATED_BITS``). A plain name (``int4``) is the runtime's default for it.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from unittest import mock

from runtime.cache.low_bit_kv import (
    CLIPPED_KEY_BITS,
    EXACT_FIRST_BLOCK_BITS,
    KEYS_BEFORE_ROPE_BITS,
    KEYS_ROTATED_BITS,
    LOW_BIT_KV,
)

VARIANTS = ("quantized-first-block", "exact-first-block", "keys-after-rope", "keys-clipped", "keys-unrotated")


@contextmanager
def served_kv_variant(kv: str) -> Iterator[str]:
    """Within the block, engines built store ``kv``'s variant; yields the KV dtype to ask them for."""
    dtype, _, how = kv.partition(":")
    if how and how not in VARIANTS:
        raise SystemExit(f"unknown KV variant {how!r} of {dtype}: choose one of {', '.join(VARIANTS)}")
    widths = LOW_BIT_KV[dtype].widths if dtype in LOW_BIT_KV else frozenset()
    key_bits = {LOW_BIT_KV[dtype].keys} if dtype in LOW_BIT_KV else set()
    exact_first = {"quantized-first-block": EXACT_FIRST_BLOCK_BITS - widths,
                   "exact-first-block": EXACT_FIRST_BLOCK_BITS | widths}.get(how, EXACT_FIRST_BLOCK_BITS)
    before_rope = KEYS_BEFORE_ROPE_BITS - key_bits if how == "keys-after-rope" else KEYS_BEFORE_ROPE_BITS
    clipped = CLIPPED_KEY_BITS | key_bits if how == "keys-clipped" else CLIPPED_KEY_BITS
    rotated = KEYS_ROTATED_BITS - key_bits if how == "keys-unrotated" else KEYS_ROTATED_BITS
    with ExitStack() as stack:
        for target, value in (("runtime.cache.kv_cache.EXACT_FIRST_BLOCK_BITS", frozenset(exact_first)),
                              ("runtime.cache.packed_layer.KEYS_BEFORE_ROPE_BITS", frozenset(before_rope)),
                              ("runtime.cache.low_bit_kv.CLIPPED_KEY_BITS", frozenset(clipped)),
                              ("runtime.cache.kv_cache.KEYS_ROTATED_BITS", frozenset(rotated))):
            stack.enter_context(mock.patch(target, value))
        yield dtype
