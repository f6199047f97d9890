"""Layer-local reconstruction: each rewritten attention fitted to the teacher's, on the teacher's inputs.

One step runs the teacher's decoder (no lm_head) once, keeping every layer's input and the
attention outputs of the rewritten layers; then the student's decoder with every layer's input
replaced by the teacher's (teacher forcing) and its MLPs switched off, since a layer's output is
thrown away. The loss is each rewritten layer's attention-output error, relative per token,
averaged. No lm_head, no MLP and no backward beyond the attention modules, so a step costs a
fraction of end-to-end distillation's; a KV-sharing reader still reads its owner's keys and
values, computed in the same pass from the owner's (teacher) input, so owners learn through their
readers. The end-to-end KL stage follows (``HealSpec.local_steps``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import nn


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder (``model.model``) of a causal LM, through a PEFT wrapper if there is one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model


def _first_output(output):
    return output[0] if isinstance(output, tuple) else output


@contextlib.contextmanager
def _capture_attention(decoder: nn.Module, layers: Sequence[int], into: dict[int, torch.Tensor],
                       detach: bool) -> Iterator[None]:
    def hook(i: int):
        def fn(_module, _args, output):
            out = _first_output(output)
            into[i] = out.detach() if detach else out
        return fn

    handles = [decoder.layers[i].self_attn.register_forward_hook(hook(i)) for i in layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _teacher_forced(decoder: nn.Module, inputs: Sequence[torch.Tensor]) -> Iterator[None]:
    """Every decoder layer of ``decoder`` takes ``inputs[i]`` as its hidden states; MLPs return zeros."""
    def pre(i: int):
        def fn(_module, args, kwargs):
            if args:
                return (inputs[i].to(args[0].dtype), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": inputs[i].to(kwargs["hidden_states"].dtype)}
        return fn

    handles = [layer.register_forward_pre_hook(pre(i), with_kwargs=True) for i, layer in enumerate(decoder.layers)]
    for layer in decoder.layers:
        layer.mlp.forward = torch.zeros_like  # the layer's output is replaced by the next teacher input
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for layer in decoder.layers:
            del layer.mlp.forward  # the class's forward again


def relative_error(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of ``|s - t|^2 / |t|^2`` (per token, so attention-sink tokens do not dominate)."""
    t = teacher.float()
    return ((student.float() - t).pow(2).sum(-1) / t.pow(2).sum(-1).clamp_min(1e-6)).mean()


@torch.no_grad()
def teacher_targets(teacher: nn.Module, input_ids: torch.Tensor, layers: Sequence[int]
                    ) -> tuple[tuple[torch.Tensor, ...], dict[int, torch.Tensor]]:
    """The teacher's input to every decoder layer and the attention outputs of ``layers``."""
    decoder = decoder_of(teacher)
    attention: dict[int, torch.Tensor] = {}
    with _capture_attention(decoder, layers, attention, detach=True):
        out = decoder(input_ids=input_ids, use_cache=False, output_hidden_states=True)
    return tuple(out.hidden_states[: len(decoder.layers)]), attention


def local_loss(student: nn.Module, teacher: nn.Module, input_ids: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
    """The rewritten ``layers``' attention-output error, student on the teacher's inputs, averaged."""
    inputs, targets = teacher_targets(teacher, input_ids, layers)
    decoder = decoder_of(student)
    outputs: dict[int, torch.Tensor] = {}
    with _teacher_forced(decoder, inputs), _capture_attention(decoder, layers, outputs, detach=False):
        decoder(input_ids=input_ids, use_cache=False)
    return torch.stack([relative_error(outputs[i], targets[i]) for i in layers]).mean()
