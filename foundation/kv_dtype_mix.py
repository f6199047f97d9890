"""KV dtypes per kind of cache entry: one name for a cache whose groups store different dtypes.

``"int4"`` stores every entry's KV in int4. ``"int8/int2"`` stores full-attention KV (full layers,
and the full heads of a layer whose heads are split) in int8 and windowed KV (sliding layers and
streaming heads, which hold only their sinks and window) in int2: the heads that reach back over the
whole context keep the precision retrieval needs, while the heads that hold a few hundred tokens
take the fewest bits. The name is what ``plan.json``, the engine and the KV report carry.
"""
from __future__ import annotations

from dataclasses import dataclass

from foundation.errors import KvslimError

SEPARATOR = "/"


@dataclass(frozen=True)
class KvDtypeMix:
    """The KV dtype of full-attention entries and of windowed ones (the cache's dtype names)."""

    full: str
    windowed: str

    @classmethod
    def parse(cls, name: str, known: tuple[str, ...]) -> "KvDtypeMix":
        """``"int4"`` or ``"int8/int2"``; a one-line error naming what is wrong."""
        parts = name.split(SEPARATOR) if isinstance(name, str) else []
        if len(parts) not in (1, 2) or any(p not in known for p in parts):
            raise KvslimError(f"unknown KV dtype {name!r}; choose one of {', '.join(known)}, or FULL{SEPARATOR}WINDOWED "
                              f"(e.g. int8{SEPARATOR}int2: full-attention KV in int8, sliding and streaming KV in int2)")
        return cls(parts[0], parts[-1])

    def of(self, kind: str) -> str:
        """The dtype of an entry of ``kind`` (``"full"`` or ``"sliding"``)."""
        return self.windowed if kind == "sliding" else self.full

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.full, self.windowed)))

    @property
    def name(self) -> str:
        return self.full if self.full == self.windowed else f"{self.full}{SEPARATOR}{self.windowed}"
