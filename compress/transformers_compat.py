"""Which of our checkpoints transformers' one-line ``from_pretrained(dir)`` loads as written.

transformers hands a compressed-tensors checkpoint to compressed-tensors, whose default route
builds every quantized Linear compressed on the meta device and then loads the stored tensors
into it. In compressed-tensors 0.20 that build packs the weight but not the zero point, so an
asymmetric packed scheme (``W4A16_ASYM``) expects ``weight_zero_point`` as ``[out, groups]``
while the format (and compressed-tensors' own compressor, and vLLM) store it packed,
``[out / 8, groups]``: the load stops on a size mismatch. Decompressing at load time reads the
format correctly (tests/compress/test_interop.py covers both routes).
"""
from __future__ import annotations

from foundation.schemes import QuantScheme

DEQUANTIZE_ROUTE = ("AutoModelForCausalLM.from_pretrained(DIR, "
                    "quantization_config=CompressedTensorsConfig(dequantize=True))")


def default_route_fails(scheme: QuantScheme | None) -> bool:
    """True when plain ``from_pretrained(dir)`` cannot load a checkpoint of ``scheme``."""
    return scheme is not None and scheme.is_packed and not scheme.symmetric


def loading_note(scheme: QuantScheme | None) -> str | None:
    """One line for ``compress quantize`` and ``compress inspect`` when the default route fails."""
    if not default_route_fails(scheme):
        return None
    return (f"note: {scheme.name} stores packed zero points, which transformers' default compressed-tensors "
            f"route (compressed-tensors <= 0.20) cannot load; use {DEQUANTIZE_ROUTE} (vLLM and kvslim load it as is)")
