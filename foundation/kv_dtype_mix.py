"""KV dtypes per kind of cache entry: one name for a cache whose groups store different dtypes.

``"int4"`` stores every entry's KV in int4. ``"int8/int2"`` stores full-attention KV (full layers,
and the full heads of a layer whose heads are split) in int8 and windowed KV (sliding layers and
streaming heads, which hold only their sinks and window) in int2: the heads that reach back over the
whole context keep the precision retrieval needs, while the heads that hold a few hundred tokens
take the fewest bits. The name is what ``plan.json``, the engine and the KV report carry.

Packed KV (int4, k4v2, k3v2, int2) follows the runtime's measured storage rules per code width
(``runtime.cache.low_bit_kv``); a name may ask for *variants* of them after a colon, joined by
``+``: ``"int4:exact-first-block"``, ``"int8/int2:keys-unclipped+values-unrotated"``. They apply to
every packed part of the name (``runtime.cache.packed_recipe``); a checkpoint whose model reads
best with one records it in its ``plan.json``.
"""
from __future__ import annotations

from dataclasses import dataclass

from foundation.errors import KvslimError

SEPARATOR = "/"
VARIANT_MARK = ":"
VARIANT_JOIN = "+"
# variant -> what it changes, in the order a name lists them
KV_VARIANTS: dict[str, str] = {
    "exact-first-block": "each sequence's first block (its attention sinks) kept exact while it runs",
    "quantized-first-block": "each sequence's first block read quantized like any other",
    "keys-unrotated": "4-bit keys kept in the model's basis, not a rotated one",
    "keys-after-rope": "2- and 3-bit keys stored after RoPE, not before it",
    "keys-clipped": "every key width's channel ranges clipped (as 2-bit keys' are)",
    "keys-unclipped": "no key channel range clipped",
    "values-unrotated": "2-bit values kept in the model's basis, not a rotated one",
}
_OPPOSITES = (("exact-first-block", "quantized-first-block"), ("keys-clipped", "keys-unclipped"))


def split_variants(name: str) -> tuple[str, tuple[str, ...]]:
    """``"int8/int2:a+b"`` -> ``("int8/int2", ("a", "b"))``, unchecked (``KvDtypeMix.parse`` checks)."""
    base, _, suffix = name.partition(VARIANT_MARK)
    return base, tuple(suffix.split(VARIANT_JOIN)) if suffix else ()


@dataclass(frozen=True)
class KvDtypeMix:
    """The KV dtype of full-attention entries and of windowed ones (the cache's dtype names), and the
    packed-KV variants asked for (``KV_VARIANTS``)."""

    full: str
    windowed: str
    variants: tuple[str, ...] = ()

    @classmethod
    def parse(cls, name: str, known: tuple[str, ...]) -> "KvDtypeMix":
        """``"int4"``, ``"int8/int2"``, ``"int4:exact-first-block"``; a one-line error naming what is wrong."""
        base, asked = split_variants(name) if isinstance(name, str) else ("", ())
        parts = base.split(SEPARATOR) if base else []
        if len(parts) not in (1, 2) or any(p not in known for p in parts):
            raise KvslimError(f"unknown KV dtype {name!r}; choose one of {', '.join(known)}, or FULL{SEPARATOR}WINDOWED "
                              f"(e.g. int8{SEPARATOR}int2: full-attention KV in int8, sliding and streaming KV in int2)")
        unknown = [v for v in asked if v not in KV_VARIANTS]
        if unknown or (VARIANT_MARK in name and not asked):
            raise KvslimError(f"unknown KV variant {(unknown or [''])[0]!r} in {name!r}; choose from "
                              f"{', '.join(KV_VARIANTS)} (joined by {VARIANT_JOIN})")
        for a, b in _OPPOSITES:
            if a in asked and b in asked:
                raise KvslimError(f"KV variants {a} and {b} contradict each other ({name!r})")
        return cls(parts[0], parts[-1], tuple(v for v in KV_VARIANTS if v in asked))

    def of(self, kind: str) -> str:
        """The dtype of an entry of ``kind`` (``"full"`` or ``"sliding"``)."""
        return self.windowed if kind == "sliding" else self.full

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.full, self.windowed)))

    @property
    def name(self) -> str:
        base = self.full if self.full == self.windowed else f"{self.full}{SEPARATOR}{self.windowed}"
        return f"{base}{VARIANT_MARK}{VARIANT_JOIN.join(self.variants)}" if self.variants else base
