"""Scale tuning: after quantization, fit every quantized Linear's scales end to end.

The integer (or FP8) codes a quantizer chose stay fixed; each scale is multiplied by a factor
``m`` (initially 1) trained to make the quantized model's next-token distribution match the
original's (KL divergence on logits) on the calibration windows: the end-to-end step of
EfficientQAT (Chen et al., 2024, "E2E-QP"), with the original model as teacher. Only the
``weight_scale`` tensors change, so the checkpoint keeps its format, bytes and loaders.

It holds two copies of the model in fp32, the factors and their optimizer state, and one
calibration window's activations (the batch's windows are run one at a time, gradients accumulated): for
small models on the CPU, or larger ones on a GPU. GPTQ / RTN stay layer-streamed; this pass does not.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.utils import parametrize

from foundation.calibration import check_ids_in_vocab
from foundation.checkpoint import Checkpoint
from foundation.errors import KvslimError
from foundation.primitives import decode_linear, dequantize
from foundation.quant_spec import QuantSpec
from foundation.schemes import QuantScheme

DEFAULT_BATCH_WINDOWS = 4
DEFAULT_LEARNING_RATE = 1e-3
_SCALE = "weight_scale"
# What foundation.primitives.encode_linear stores for a quantized Linear.
_STORED = ("weight", "weight_packed", "weight_shape", _SCALE, "weight_zero_point", "weight_g_idx")


@dataclass(frozen=True)
class ScaleTuningSpec:
    """``steps`` optimizer steps over batches of ``batch_windows`` calibration windows (AdamW on
    the scale factors, cosine schedule from ``learning_rate`` to 0)."""

    steps: int
    batch_windows: int = DEFAULT_BATCH_WINDOWS
    learning_rate: float = DEFAULT_LEARNING_RATE
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps <= 0:
            raise KvslimError(f"--tune-scales-steps must be positive, got {self.steps}")
        if self.batch_windows <= 0 or not self.learning_rate > 0:
            raise KvslimError("scale tuning needs a positive batch and learning rate")


@dataclass(frozen=True)
class ScaleTuningReport:
    steps: int
    tokens: int  # calibration tokens seen (with repeats)
    kl_first: float  # mean KL (nats/token) of the first batch, before any update
    kl_last: float  # of the last batch
    seconds: float
    scales: int  # scale values tuned

    def describe(self) -> str:
        return (f"scale tuning: {self.steps} steps, {self.tokens:,} tokens, {self.scales:,} scales, "
                f"KL {self.kl_first:.4f} -> {self.kl_last:.4f} nats/token, {self.seconds:.0f} s")


class _ScaleFactor(nn.Module):
    """``w -> w * m`` with ``m [rows, groups]`` repeated over each group's columns."""

    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.m = nn.Parameter(torch.ones_like(scale, dtype=torch.float32))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.m.repeat_interleave(w.shape[1] // self.m.shape[1], dim=1)


def check_tunable(scheme: QuantScheme) -> None:
    """Refuse schemes that quantize activations: tuning their weight scales raised perplexity on the
    default model (FP8_DYNAMIC on the dev slice: +1.31% to +1.36% tuned, +0.84% GPTQ alone)."""
    if scheme.input_activations is not None:
        raise KvslimError(f"--tune-scales-steps supports weight-only schemes; {scheme.name} quantizes activations too")


def _quantized_modules(ckpt: Checkpoint) -> list[str]:
    return sorted(name[: -len(_SCALE) - 1] for name in ckpt.names() if name.endswith("." + _SCALE))


@torch.enable_grad()
def tune_scales(
    source: str | Path, quantized: str | Path, ids: torch.Tensor, spec: ScaleTuningSpec, progress: bool = True
) -> ScaleTuningReport:
    """Tune the scales of the quantized checkpoint ``quantized`` (rewritten in place: call it on
    a directory that is not yet published) against ``source`` on token windows ``ids [n, seq]``."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    ckpt = Checkpoint.open(quantized)
    quant = QuantSpec.of_model_config(ckpt.config)
    if quant is None:
        raise KvslimError(f"{ckpt.path} is not quantized; scale tuning needs a quantized checkpoint")
    for group in quant.groups:
        check_tunable(group.scheme)
    check_ids_in_vocab(ids, ckpt.config, source)
    teacher = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    for p in student.parameters():
        p.requires_grad_(False)
    submodules = dict(student.named_modules())
    factors: dict[str, _ScaleFactor] = {}
    scales: dict[str, torch.Tensor] = {}
    for module in _quantized_modules(ckpt):
        if module == "lm_head":  # its own --lm-head scheme, round-to-nearest (a tied source shares it with the embedding)
            continue
        scheme = quant.scheme_for(module)
        if module not in submodules or not isinstance(submodules[module], nn.Linear):
            raise KvslimError(f"{ckpt.path}: quantized tensor {module}.{_SCALE} has no Linear in {source}")
        tensors = {key: ckpt.get(f"{module}.{key}") for key in _STORED if ckpt.has(f"{module}.{key}")}
        q, scale, zero, g_idx = decode_linear(tensors, scheme)
        if g_idx is not None:
            raise KvslimError(f"{module}: scale tuning does not support weight_g_idx")
        linear = submodules[module]
        linear.weight.data = dequantize(q, scale, zero, scheme).to(torch.float32)
        factors[module] = _ScaleFactor(scale)
        parametrize.register_parametrization(linear, "weight", factors[module])
        scales[module] = scale
    params = [f.m for f in factors.values()]
    optimizer = torch.optim.AdamW(params, lr=spec.learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / spec.steps)))
    generator = torch.Generator().manual_seed(spec.seed)
    order: list[int] = []
    kls: list[float] = []
    bar = tqdm(range(spec.steps), desc="tune scales", unit="step", disable=not progress)
    for _ in bar:
        if len(order) < spec.batch_windows:
            order += torch.randperm(ids.shape[0], generator=generator).tolist()
        batch = ids[order[: spec.batch_windows]]
        del order[: spec.batch_windows]
        optimizer.zero_grad(set_to_none=True)
        kl = 0.0
        for window in batch.split(1):  # one window's activations alive at a time; gradients accumulate
            with torch.no_grad():
                target = torch.log_softmax(teacher(input_ids=window).logits, dim=-1).flatten(0, 1)
            logp = torch.log_softmax(student(input_ids=window).logits, dim=-1).flatten(0, 1)
            loss = torch.nn.functional.kl_div(logp, target, log_target=True, reduction="sum") / batch.numel()
            loss.backward()
            kl += float(loss.detach())
            del target, logp, loss
        optimizer.step()
        schedule.step()
        kls.append(kl)
        bar.set_postfix_str(f"KL {kls[-1]:.4f}")
    del teacher, student, optimizer
    tuned = {f"{m}.{_SCALE}": (scales[m].to(torch.float32) * factors[m].m.detach().clamp_min(1e-3)).to(scales[m].dtype)
             for m in factors}
    _rewrite_tensors(ckpt, tuned)
    return ScaleTuningReport(spec.steps, spec.steps * spec.batch_windows * ids.shape[1], kls[0], kls[-1],
                             time.perf_counter() - start, sum(s.numel() for s in scales.values()))


def _rewrite_tensors(ckpt: Checkpoint, replacements: dict[str, torch.Tensor]) -> None:
    """Replace tensors (same shape and dtype) in the checkpoint's shard files."""
    by_file: dict[Path, list[str]] = {}
    for name in replacements:
        by_file.setdefault(ckpt.weight_map[name], []).append(name)
    for path, names in by_file.items():
        tensors = load_file(str(path))
        for name in names:
            old, new = tensors[name], replacements[name]
            if old.shape != new.shape or old.dtype != new.dtype:
                raise RuntimeError(f"{name}: tuned tensor {tuple(new.shape)} {new.dtype} does not match the stored one")
            tensors[name] = new.contiguous()
        tmp = path.with_name(path.name + ".part")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        del tensors
        tmp.replace(path)
