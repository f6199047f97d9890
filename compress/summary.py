"""Per-tensor quantization statistics and the tables ``compress quantize`` prints."""
from __future__ import annotations

from dataclasses import dataclass

from foundation.architecture import ATTENTION_PROJECTIONS, MLP_PROJECTIONS

BF16_BYTES = 2


def tensor_kind(name: str) -> str:
    """A coarse kind for a checkpoint tensor name, for byte tables."""
    module, _, leaf = name.rpartition(".")
    last = module.rsplit(".", 1)[-1]
    if "embed" in last:
        return "embedding"
    if last == "lm_head":
        return "lm_head"
    if leaf == "bias":
        return "bias"
    if "norm" in last:
        return "norm"
    if last in ATTENTION_PROJECTIONS:
        return "attention linear"
    if last in MLP_PROJECTIONS:
        return "mlp linear"
    return "other"


@dataclass(frozen=True)
class TensorStat:
    """One source tensor: its bytes before/after and, when quantized, its weight error."""

    name: str
    kind: str
    source_dtype: str
    params: int
    bytes_before: int  # as stored in the source
    bytes_after: int  # all tensors written for it (packed weight, scales, zero points, shape)
    quantized: bool
    mean_abs_error: float
    max_abs_error: float
    rel_error: float  # ||W_q - W|| / ||W|| (Frobenius)

    @property
    def bytes_bf16(self) -> int:
        """The reference size: the same parameters at 2 bytes each, whatever the source dtype."""
        return self.params * BF16_BYTES


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def quantize_table(stats: list[TensorStat] | tuple[TensorStat, ...]) -> str:
    """Bytes before/after by tensor kind, ratio against bf16, mean/max weight error."""
    kinds: dict[str, list[TensorStat]] = {}
    for s in stats:
        kinds.setdefault(s.kind, []).append(s)
    header = ("kind", "tensors", "params", "src dtype", "before MiB", "bf16 MiB", "after MiB",
              "x vs bf16", "mean |err|", "max |err|", "rel err")
    rows = [_row(kind, group) for kind, group in sorted(kinds.items())]
    rows.append(_row("total", list(stats)))
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, lines[1])
    return "\n".join(lines)


def _row(kind: str, group: list[TensorStat]) -> tuple:
    params = sum(s.params for s in group)
    before = sum(s.bytes_before for s in group)
    after = sum(s.bytes_after for s in group)
    bf16 = params * BF16_BYTES
    q = [s for s in group if s.quantized]
    qparams = sum(s.params for s in q)
    if q:
        mean = f"{sum(s.mean_abs_error * s.params for s in q) / qparams:.2e}"
        mx = f"{max(s.max_abs_error for s in q):.2e}"
        rel = f"{sum(s.rel_error * s.params for s in q) / qparams:.4f}"
    else:
        mean = mx = rel = "-"
    dtypes = ",".join(sorted({s.source_dtype for s in group}))
    return (kind, len(group), f"{params:,}", dtypes, _mib(before), _mib(bf16), _mib(after),
            f"{bf16 / after:.2f}" if after else "-", mean, mx, rel)


def totals(stats: list[TensorStat] | tuple[TensorStat, ...]) -> dict[str, float]:
    """Whole-checkpoint figures: bytes before/after, bf16 reference, ratio, quantized share."""
    before = sum(s.bytes_before for s in stats)
    after = sum(s.bytes_after for s in stats)
    bf16 = sum(s.bytes_bf16 for s in stats)
    q = [s for s in stats if s.quantized]
    return {
        "bytes_before": before,
        "bytes_after": after,
        "bytes_bf16": bf16,
        "ratio_vs_bf16": bf16 / after if after else 0.0,
        "quantized_params": sum(s.params for s in q),
        "params": sum(s.params for s in stats),
        "quantized_bytes_after": sum(s.bytes_after for s in q),
        "quantized_ratio_vs_bf16": (sum(s.bytes_bf16 for s in q) / sum(s.bytes_after for s in q)) if q else 0.0,
        "mean_abs_error": (sum(s.mean_abs_error * s.params for s in q) / sum(s.params for s in q)) if q else 0.0,
        "max_abs_error": max((s.max_abs_error for s in q), default=0.0),
    }
