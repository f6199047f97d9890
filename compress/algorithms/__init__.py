"""Weight quantization algorithms: one Linear's float weight -> its compressed-tensors tensors.

Every algorithm implements ``WeightQuantizer``. The streaming driver (``compress.quantize``)
calls ``quantize`` once per quantized Linear, visiting decoder layers in order (all of layer 0's
Linears, then layer 1's, ...; non-layer Linears such as an untied ``lm_head`` last), so an
algorithm that needs calibration statistics (GPTQ's Hessian) can compute them for layer ``i``
the first time it is asked for one of that layer's modules.
"""
from __future__ import annotations

from typing import Protocol

import torch

from foundation.schemes import QuantScheme


class WeightQuantizer(Protocol):
    """Quantizes one Linear weight to its on-disk tensors."""

    name: str  # short name shown in summaries, e.g. "rtn", "gptq"

    def quantize(self, module: str, weight: torch.Tensor, scheme: QuantScheme) -> dict[str, torch.Tensor]:
        """Return the tensors compressed-tensors stores for ``module`` (e.g.
        ``model.layers.0.self_attn.q_proj``), keyed relative to it: ``weight`` or
        ``weight_packed`` + ``weight_shape``, ``weight_scale``, optional ``weight_zero_point`` /
        ``weight_g_idx`` (see ``foundation.primitives.encode_linear``)."""
        ...

    def finish(self) -> dict[str, torch.Tensor]:
        """Called once after the last Linear: extra tensors to write, by full name (e.g. the
        calibrated ``self_attn.k_scale`` / ``v_scale`` of ``--kv-cache-fp8``); usually empty."""
        ...
