"""Round-to-nearest with min-max scales: the calibration-free ``WeightQuantizer``."""
from __future__ import annotations

import torch

from foundation.primitives import compute_qparams, encode_linear, quantize
from foundation.schemes import QuantScheme


class RTN:
    """Min-max scales per channel / group, values rounded to nearest (compressed-tensors' math)."""

    name = "rtn"

    def quantize(self, module: str, weight: torch.Tensor, scheme: QuantScheme) -> dict[str, torch.Tensor]:
        scale, zero_point = compute_qparams(weight, scheme)
        return encode_linear(quantize(weight, scale, zero_point, scheme), scale, zero_point, scheme)

    def finish(self) -> dict[str, torch.Tensor]:
        return {}
