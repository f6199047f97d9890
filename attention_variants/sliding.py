"""Hybrid sliding window: every layer local with window W except the global ones.

Global layers are one in ``G`` (layers ``G-1, 2G-1, ...``, Gemma 3's pattern), named ones, or,
with calibration, as many layers (or as many as named) whose attention puts the most
probability on keys at least ``W`` tokens back on real text.

Attention sinks (StreamingLLM: the first S tokens stay visible to local layers) are a config key,
``num_sink_tokens``, that ``convert`` writes beside the layout (``foundation.attention_layout``).
"""
from __future__ import annotations

from typing import Literal

from attention_variants.attention_inputs import AttentionInputs
from foundation.attention_layout import FULL, SLIDING

GlobalSelect = Literal["fixed", "calib"]


def global_layers_every(num_layers: int, every: int) -> list[int]:
    """One global layer in ``every``: the last of each run of ``every`` layers."""
    return [i for i in range(num_layers) if (i + 1) % every == 0]


def global_layers_by_far_mass(calib: AttentionInputs, count: int) -> list[int]:
    """The ``count`` layers with the most attention mass beyond the calibration window."""
    ranked = sorted(range(len(calib.far_mass)), key=lambda i: -calib.far_mass[i])
    return sorted(ranked[:count])


def hybrid_layer_types(
    num_layers: int,
    every: int | None,
    named: tuple[int, ...] | None,
    select: GlobalSelect = "fixed",
    calib: AttentionInputs | None = None,
) -> list[str]:
    """``layer_types`` for the hybrid layout (inputs validated by the caller)."""
    if select == "calib":
        count = len(named) if named is not None else len(global_layers_every(num_layers, every))
        globals_ = global_layers_by_far_mass(calib, count)
    else:
        globals_ = list(named) if named is not None else global_layers_every(num_layers, every)
    return [FULL if i in globals_ else SLIDING for i in range(num_layers)]
