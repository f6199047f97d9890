"""A checkpoint's declared compressed-tensors quantization: which scheme each Linear is stored in.

``QuantSpec.from_config`` only parses (any scheme ``foundation.schemes`` can describe); what the
runtime can serve is checked by ``runtime.spec`` before it asks for one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from foundation.errors import KvslimError
from foundation.schemes import QuantScheme, scheme_from_config_group


@dataclass(frozen=True)
class QuantGroup:
    """One ``config_groups`` entry: which Linears it targets and how their weights are stored."""

    targets: tuple[str, ...]
    scheme: QuantScheme


@dataclass(frozen=True)
class QuantSpec:
    """The checkpoint's declared compressed-tensors quantization (``quantization_config``)."""

    format: str
    groups: tuple[QuantGroup, ...]
    ignore: tuple[str, ...]
    kv_cache_scheme: tuple[tuple[str, Any], ...] | None = None

    @staticmethod
    def _matches(pattern: str, name: str) -> bool:
        if pattern.startswith("re:"):
            return re.match(pattern[3:], name) is not None
        return pattern == "Linear" or name == pattern or name.endswith("." + pattern)

    def scheme_for(self, linear_name: str) -> QuantScheme | None:
        """The scheme of the Linear ``linear_name`` (e.g. ``model.layers.0.mlp.up_proj``), or
        ``None`` when it is ignored or not targeted (kept in floating point)."""
        if any(self._matches(p, linear_name) for p in self.ignore):
            return None
        for group in self.groups:
            if any(self._matches(t, linear_name) for t in group.targets):
                return group.scheme
        return None

    @classmethod
    def from_config(cls, qc: dict) -> "QuantSpec":
        groups = []
        for name, group in (qc.get("config_groups") or {}).items():
            targets = tuple(group.get("targets") or ())
            if not targets:
                raise KvslimError(f"quantization group {name} has no targets")
            groups.append(QuantGroup(targets, scheme_from_config_group(group)))
        kv = qc.get("kv_cache_scheme")
        return cls(
            format=str(qc.get("format")),
            groups=tuple(groups),
            ignore=tuple(qc.get("ignore") or ()),
            kv_cache_scheme=tuple(sorted(kv.items())) if kv else None,
        )
