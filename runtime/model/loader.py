"""Checkpoint directory -> ``Decoder``: config.json and safetensors only, never code or pickles.

Before anything is built, every tensor the config implies is checked against the safetensors
headers (``foundation.tensor_shapes``: present, dtype, shape, packed layout of the declared scheme),
so a damaged checkpoint is refused with one line naming the tensor, not on its first forward.
Each Linear is built from its tensors and the scheme ``quantization_config`` declares for it
(``runtime.model.layers.linear.make_linear``). Every tensor of the checkpoint must be used: a leftover
means the runtime misread the checkpoint, and loading stops with a ``CheckpointError`` naming it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from foundation.checkpoint import Checkpoint
from foundation.errors import CheckpointError, KvslimError
from foundation.primitives import LINEAR_TENSORS
from foundation.tensor_shapes import check_tensors, check_understood, expected_tensors
from runtime.device import CPU, Placement
from runtime.model.decoder import Decoder
from runtime.model.layers.activation_dtype import ActivationDtype, CpuFeatures, choose_activation_dtype
from runtime.model.layers.cpu_kernels import CpuKernelChoice
from runtime.model.layers.fused_linear import (
    FusedLinear,
    SeparateLinears,
    in_features,
    out_features,
    stack_linear_tensors,
)
from runtime.model.layers.linear import check_linear_tensors, make_linear
from runtime.model.spec import ModelSpec


class CheckpointWeights:
    """``WeightSource`` over an open checkpoint; records which tensors were taken."""

    def __init__(
        self, ckpt: Checkpoint, spec: ModelSpec, dtype: torch.dtype, use_cpu_kernels: bool, fuse: bool = True,
        placement: Placement = CPU, cpu_kernels: CpuKernelChoice | None = None,
    ) -> None:
        self.ckpt, self.spec, self.dtype, self.use_cpu_kernels = ckpt, spec, dtype, use_cpu_kernels
        self.fuse = fuse
        self.kernels = dict(kernels=placement.kernels, interpreted=placement.triton_interpreted,
                            int8_gemm=cpu_kernels.int8_gemm if cpu_kernels else True)
        self.used: set[str] = set()

    def check_tensors(self) -> None:
        """Every tensor the config and declared schemes imply is there, typed and shaped as they say."""
        kv_scheme = self.spec.quant.kv_scheme if self.spec.quant else None
        check_tensors(self.ckpt, expected_tensors(self.spec, self._scheme, kv_scheme))

    def tensor(self, name: str) -> torch.Tensor:
        if not self.ckpt.has(name):
            raise CheckpointError(f"{self.ckpt.path}: missing tensor {name}")
        self.used.add(name)
        t = self.ckpt.get(name)
        if not t.is_floating_point():
            raise CheckpointError(f"{name}: expected a floating-point tensor, found {t.dtype}")
        return t

    def _linear_tensors(self, name: str, bias: bool) -> dict[str, torch.Tensor]:
        tensors = {}
        for suffix in (*LINEAR_TENSORS, "bias"):
            full = f"{name}.{suffix}"
            if self.ckpt.has(full):
                tensors[suffix] = self.ckpt.get(full)
                self.used.add(full)
        if not tensors:
            raise CheckpointError(f"{self.ckpt.path}: missing tensor {name}.weight")
        if bias != ("bias" in tensors):
            state = "has no" if bias else "has an unexpected"
            raise CheckpointError(f"{self.ckpt.path}: {name} {state} bias (config says bias={bias})")
        return tensors

    def _scheme(self, name: str):
        return self.spec.quant.scheme_for(name) if self.spec.quant else None

    def linear(self, name: str, bias: bool) -> nn.Module:
        return make_linear(name, self._linear_tensors(name, bias), self._scheme(name), self.dtype, self.use_cpu_kernels,
                           **self.kernels)

    def linears(self, names: Sequence[str], bias: bool) -> nn.Module:
        """Linears over one input (q/k/v, gate/up): one ``FusedLinear`` when fusion is on and
        their tensors stack (one scheme), else ``SeparateLinears``. Returns a module whose
        forward gives one output per name."""
        schemes = [self._scheme(n) for n in names]
        if not self.fuse or len(names) < 2 or any(s != schemes[0] for s in schemes):
            return SeparateLinears([self.linear(n, bias) for n in names])
        parts = [self._linear_tensors(n, bias) for n in names]
        widths = [in_features(p) for p in parts]
        if len(set(widths)) > 1:
            raise CheckpointError(f"{self.ckpt.path}: {', '.join(names)} read the same input but have "
                                  f"{', '.join(map(str, widths))} input features")
        for n, p in zip(names, parts):  # each part must be valid on its own: same errors as unfused
            check_linear_tensors(n, p, schemes[0])
        stacked = stack_linear_tensors(parts, schemes[0])
        if stacked is None:
            return SeparateLinears([make_linear(n, p, schemes[0], self.dtype, self.use_cpu_kernels, **self.kernels)
                                    for n, p in zip(names, parts)])
        fused = make_linear("+".join(names), stacked, schemes[0], self.dtype, self.use_cpu_kernels, **self.kernels)
        return FusedLinear(fused, [out_features(p) for p in parts])

    def check_all_used(self) -> None:
        check_understood(self.ckpt, self.used, self.spec)


def load_model(
    path: str | Path | Checkpoint, dtype: str | torch.dtype = "float32", use_cpu_kernels: bool = True, fuse: bool = True,
    placement: Placement = CPU, cpu_features: CpuFeatures | None = None,
) -> Decoder:
    """Load a checkpoint directory into a ``Decoder`` in eval mode.

    ``dtype``: activation and dense-weight dtype, or ``auto`` (``runtime.model.layers.activation_dtype``:
    by the CPU's features); the choice is ``model.activation_dtype``. Quantized weights stay packed.
    ``use_cpu_kernels``: use torch's weight-only INT4/INT8 CPU kernels where they apply (bf16), and
    ``torch._int_mm`` for W8A8 (False: its fake-quantize + dequantize reference path).
    ``fuse``: q/k/v and gate/up projections as one GEMM each where their schemes match.
    ``placement``: the device the model goes to and its kernels (``runtime.device``); torch's CPU
    kernels only on the CPU with torch kernels; Triton's interpreter (CPU) computes in fp32 only.
    ``cpu_features``: decide the CPU kernels (``cpu_kernels``) for these features (None: this CPU's);
    the choice is ``model.cpu_kernels`` (None off the CPU or with Triton).
    """
    ckpt = path if isinstance(path, Checkpoint) else Checkpoint.open(path)
    spec = ModelSpec.from_config(ckpt.config, ckpt.generation_config)
    schemes = tuple(g.scheme for g in spec.quant.groups) if spec.quant else ()
    if placement.triton_interpreted and dtype == "auto":
        choice = ActivationDtype(torch.float32, "auto: Triton's interpreter computes fp32 only")
    else:
        choice = choose_activation_dtype(dtype, schemes, placement.device, cpu_features)
    if placement.triton_interpreted and choice.dtype != torch.float32:
        raise KvslimError(f"--kernels triton on the CPU (Triton's interpreter) computes fp32 only, not {dtype}")
    on_cpu = placement == CPU
    cpu_choice = CpuKernelChoice.choose(choice.dtype, cpu_features) if on_cpu else None
    weights = CheckpointWeights(ckpt, spec, choice.dtype, use_cpu_kernels and on_cpu, fuse, placement, cpu_choice)
    weights.check_tensors()
    with torch.no_grad():
        model = Decoder(spec, weights, choice, placement)
    weights.check_all_used()
    model.cpu_kernels = cpu_choice
    return model.to(placement.device).eval().requires_grad_(False)


def live_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model``, counting shared storage once."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total
