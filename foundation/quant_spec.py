"""A checkpoint's declared compressed-tensors quantization: the one reader of ``quantization_config``.

``QuantSpec.of_model_config`` answers, for every caller, which scheme each Linear is stored in
(``scheme_for``), the group every other Linear falls in (``main_group``, for inspect) and the
KV-cache dtype it declares (``kv_dtype``). It only parses (any scheme ``foundation.schemes`` can
describe); what the runtime can serve is checked by the runtime before it asks for one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from foundation.errors import KvslimError
from foundation.schemes import QuantScheme, scheme_from_config_group

QUANT_METHOD = "compressed-tensors"


@dataclass(frozen=True)
class QuantGroup:
    """One ``config_groups`` entry: which Linears it targets and how their weights are stored."""

    targets: tuple[str, ...]
    scheme: QuantScheme
    format: str | None = None  # the group's own on-disk format, when it names one


@dataclass(frozen=True)
class QuantSpec:
    """The checkpoint's declared compressed-tensors quantization (``quantization_config``)."""

    format: str
    groups: tuple[QuantGroup, ...]
    ignore: tuple[str, ...]
    kv_cache_scheme: tuple[tuple[str, Any], ...] | None = None

    @staticmethod
    def _specificity(pattern: str, name: str) -> int | None:
        """How specifically ``pattern`` names the Linear ``name`` (compressed-tensors' order: 0 a
        name, 1 a regex, 2 the class ``Linear``), or None when it does not match."""
        if pattern.startswith("re:"):
            return 1 if re.match(pattern[3:], name) is not None else None
        if name == pattern or name.endswith("." + pattern):
            return 0
        return 2 if pattern == "Linear" else None

    @classmethod
    def _matches(cls, pattern: str, name: str) -> bool:
        return cls._specificity(pattern, name) is not None

    def scheme_for(self, linear_name: str) -> QuantScheme | None:
        """The scheme of the Linear ``linear_name`` (e.g. ``model.layers.0.mlp.up_proj``), or
        ``None`` when it is ignored or not targeted (kept in floating point). Where several groups
        target it, the most specific target wins (a name over a regex over ``Linear``), then the
        first group, as compressed-tensors decides."""
        if any(self._matches(p, linear_name) for p in self.ignore):
            return None
        best: tuple[int, QuantScheme] | None = None
        for group in self.groups:
            ranks = [r for t in group.targets if (r := self._specificity(t, linear_name)) is not None]
            if ranks and (best is None or min(ranks) < best[0]):
                best = (min(ranks), group.scheme)
        return best[1] if best else None

    @property
    def schemes(self) -> tuple[QuantScheme, ...]:
        return tuple(g.scheme for g in self.groups)

    @property
    def main_group(self) -> QuantGroup:
        """The group targeting the class ``Linear`` (every Linear no other group names), else the first."""
        return next((g for g in self.groups if "Linear" in g.targets), self.groups[0])

    @property
    def kv_scheme(self) -> dict | None:
        """``kv_cache_scheme`` as written in the config, or None."""
        return dict(self.kv_cache_scheme) if self.kv_cache_scheme else None

    @property
    def kv_dtype(self) -> str | None:
        """The KV-cache dtype the checkpoint declares (``fp8_e4m3`` / ``int8``), None when none."""
        return kv_dtype_of_scheme(self.kv_scheme)

    @classmethod
    def from_config(cls, qc: dict) -> "QuantSpec":
        """Parse a ``quantization_config`` dict."""
        groups = []
        for name, group in (qc.get("config_groups") or {}).items():
            targets = tuple(group.get("targets") or ())
            if not targets:
                raise KvslimError(f"quantization group {name} has no targets")
            if group.get("output_activations"):
                raise KvslimError(f"quantization group {name}: output activation quantization is not supported")
            groups.append(QuantGroup(targets, scheme_from_config_group(group), group.get("format")))
        kv = qc.get("kv_cache_scheme")
        return cls(
            format=str(qc.get("format")),
            groups=tuple(groups),
            ignore=tuple(qc.get("ignore") or ()),
            kv_cache_scheme=tuple(sorted(kv.items())) if kv else None,
        )

    @classmethod
    def of_model_config(cls, config: dict) -> "QuantSpec | None":
        """The ``quantization_config`` of a config.json dict, or None for an unquantized model;
        refuses any method but compressed-tensors with one line."""
        qc = config.get("quantization_config")
        if not qc:
            return None
        method = qc.get("quant_method")
        if method == "bitsandbytes":
            raise KvslimError("a bitsandbytes checkpoint loads in transformers (with bitsandbytes) or vLLM; kvslim "
                              "reads compressed-tensors checkpoints (`compress quantize --int4 | --int8` writes them)")
        if method != QUANT_METHOD:
            raise KvslimError(f"quantization_config.quant_method={method!r} is not supported; kvslim reads "
                              "compressed-tensors checkpoints (compress quantize writes them)")
        return cls.from_config(qc)


def kv_dtype_of_scheme(scheme: dict | None) -> str | None:
    """``kv_cache_scheme`` -> the KV dtype name the runtime uses (None when absent)."""
    if not scheme:
        return None
    kind = (scheme.get("type"), int(scheme.get("num_bits", 0)))
    if kind == ("float", 8):
        return "fp8_e4m3"
    if kind == ("int", 8):
        return "int8"
    raise KvslimError(f"kv_cache_scheme {scheme} is not supported (8-bit float or int only)")


def kv_cache_scheme_of(config: dict) -> dict | None:
    """``quantization_config.kv_cache_scheme`` of a config.json dict, or None."""
    spec = QuantSpec.of_model_config(config)
    return spec.kv_scheme if spec else None
