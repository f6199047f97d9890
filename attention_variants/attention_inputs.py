"""Each decoder layer's attention input on calibration text: what the calibrated rewrites fit on.

The input of layer ``l``'s attention is the output of its ``input_layernorm``; every calibrated
rewrite (GQA merges, KV-sharing selection and refits, choosing global layers) is a function of
these captured activations and the original weights. The token windows come from
``foundation.calibration``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from foundation.errors import KvslimError


@dataclass(frozen=True)
class AttentionInputs:
    """Captured attention inputs: ``inputs[l]`` is ``[num_seqs, seq_len, hidden]`` (fp32)."""

    inputs: tuple[torch.Tensor, ...]
    text: str  # the named range or file the tokens came from
    # per layer: mean attention probability on keys >= ``window`` positions back (queries past it)
    far_mass: tuple[float, ...] | None = None
    window: int | None = None

    @property
    def num_seqs(self) -> int:
        return self.inputs[0].shape[0]

    @property
    def seq_len(self) -> int:
        return self.inputs[0].shape[1]

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.seq_len

    def flat(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s inputs as ``[tokens, hidden]``."""
        x = self.inputs[layer]
        return x.reshape(-1, x.shape[-1])

    def describe(self) -> str:
        return f"{self.num_seqs} x {self.seq_len} tokens of {self.text}"


def _far_mass(attn: torch.Tensor, window: int) -> float:
    """Mean probability that queries ``i >= window`` put on keys ``j <= i - window``."""
    probs = attn[0, :, window:].float()  # [heads, queries, keys]
    rows = torch.arange(window, attn.shape[-1]).unsqueeze(1)
    far = torch.arange(attn.shape[-1]).unsqueeze(0) <= rows - window
    return float((probs * far).sum(-1).mean())


class FarMassProbe:
    """Forward hooks on every layer's attention that add, per window, the mean attention mass
    beyond it (``_far_mass``) of each sequence run, then drop the probabilities: one layer's
    ``[heads, T, T]`` at a time, so long calibration windows fit. The model must run eager
    attention (its attention modules then return the probabilities)."""

    def __init__(self, model, windows: tuple[int, ...], num_seqs: int):
        self.windows, self.num_seqs = windows, num_seqs
        layers = model.model.layers
        self.mass = {w: [0.0] * len(layers) for w in windows}
        self._hooks = [layer.self_attn.register_forward_hook(self._hook(i))
                       for i, layer in enumerate(layers)] if windows else []

    def _hook(self, i: int):
        def hook(_module, _inputs, out):
            attn = out[1] if isinstance(out, tuple) and len(out) > 1 else None
            if attn is None:
                raise KvslimError("measuring attention mass needs eager attention (no probabilities returned)")
            for w in self.windows:
                self.mass[w][i] += _far_mass(attn.detach(), w) / self.num_seqs
        return hook

    def remove(self) -> dict[int, tuple[float, ...]]:
        """Remove the hooks; the mass per window, per layer."""
        for h in self._hooks:
            h.remove()
        return {w: tuple(m) for w, m in self.mass.items()}


def _check_windows(ids: torch.Tensor, windows: tuple[int, ...]) -> None:
    if windows and ids.shape[1] <= max(windows):
        raise KvslimError(f"calibration sequences of {ids.shape[1]} tokens cannot measure attention beyond window "
                          f"{max(windows)}")


@torch.no_grad()
def capture_attention_inputs(model, ids: torch.Tensor, text: str, window: int | None = None) -> AttentionInputs:
    """Run ``model`` over ``ids`` ``[num_seqs, seq_len]`` and keep every layer's attention input.

    With ``window``, also measure each layer's attention mass beyond it (the model must use eager
    attention so the probabilities exist); the sequences must be longer than the window.
    """
    layers = model.model.layers
    captured: list[list[torch.Tensor]] = [[] for _ in layers]
    windows = () if window is None else (window,)
    _check_windows(ids, windows)
    hooks = [
        layer.input_layernorm.register_forward_hook(
            lambda _m, _inp, out, i=i: captured[i].append(out.detach().float())
        )
        for i, layer in enumerate(layers)
    ]
    probe = FarMassProbe(model, windows, ids.shape[0])
    try:
        for row in ids:
            model(input_ids=row.unsqueeze(0), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        mass = probe.remove()
    inputs = tuple(torch.cat(c, dim=0) for c in captured)
    return AttentionInputs(inputs, text, mass[window] if window is not None else None, window)
