"""One generic decoder for Llama, Qwen2, Qwen3, Mistral and Gemma 3 (text), driven by ModelSpec.

API (what the engine calls; the batch is flattened, see ``runtime/attention/backend.py``)::

    model = load_model(checkpoint_dir, dtype=torch.bfloat16)        # runtime.model.loader
    hidden = model(input_ids, positions, backend)   # input_ids, positions: int64 [T] -> [T, hidden]
    logits = model.compute_logits(hidden[selected])  # [N, hidden] -> fp32 [N, vocab]

``forward`` returns the final-normed hidden states of every token in the step; the caller picks
the rows it needs logits for (the last token of each sequence when decoding, every token for
prompt logprobs) and calls ``compute_logits`` on them only.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from foundation.architecture import QKV_PROJECTIONS
from foundation.tensor_shapes import layer_linears
from runtime.attention.backend import AttentionBackend
from runtime.device import CPU, Placement
from runtime.model.layers.activation_dtype import ActivationDtype
from runtime.model.layers.attention import Attention
from runtime.model.layers.cpu_kernels import CpuKernelChoice
from runtime.model.layers.mlp import GatedMLP
from runtime.model.layers.norm import RMSNorm
from runtime.model.layers.rotary import RotaryEmbedding
from runtime.model.layers.small_ops import SmallOps
from runtime.model.spec import ModelSpec


class WeightSource(Protocol):
    """Where the decoder gets its parameters (``runtime.model.loader`` reads them from a checkpoint)."""

    def tensor(self, name: str) -> torch.Tensor: ...

    def linear(self, name: str, bias: bool) -> nn.Module: ...

    def linears(self, names: Sequence[str], bias: bool) -> nn.Module:
        """Linears over one input; the module returns one output per name (fused where possible)."""
        ...


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, i: int, w: WeightSource, dtype: torch.dtype, ops: SmallOps = SmallOps()) -> None:
        super().__init__()
        self.ops = ops
        p = f"model.layers.{i}."
        la = spec.attention.layers[i]

        def norm(name: str, dim: int) -> RMSNorm:
            n = RMSNorm(dim, spec.rms_norm_eps, spec.norm_offset)
            weight = w.tensor(p + name + ".weight")
            n.weight.data = weight.float() if spec.norm_offset else weight.to(dtype)
            return n

        linears = layer_linears(spec, i)  # a KV reader has no k/v projections: q alone
        qkv = [linears[n].module for n in QKV_PROJECTIONS if n in linears]
        self.self_attn = Attention(
            i, spec.num_heads, la.num_kv_heads, spec.head_dim,
            qkv_proj=w.linears(qkv, spec.qkv_bias),
            o_proj=w.linear(linears["o_proj"].module, spec.o_bias),
            q_norm=norm("self_attn.q_norm", spec.head_dim) if spec.qk_norm else None,
            k_norm=norm("self_attn.k_norm", spec.head_dim) if spec.qk_norm and spec.owns_kv(i) else None,
            parts=spec.attention.entry_parts[i],
            ops=ops,
        )
        self.mlp = GatedMLP(
            w.linears([linears["gate_proj"].module, linears["up_proj"].module], spec.mlp_bias),
            w.linear(linears["down_proj"].module, spec.mlp_bias),
            spec.hidden_act,
            ops,
        )
        self.input_layernorm = norm("input_layernorm", spec.hidden_size)
        self.post_attention_layernorm = norm("post_attention_layernorm", spec.hidden_size)
        self.sandwich = spec.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm = norm("pre_feedforward_layernorm", spec.hidden_size)
            self.post_feedforward_layernorm = norm("post_feedforward_layernorm", spec.hidden_size)

    def forward(self, h: torch.Tensor, pending: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """``h``: the residual stream before ``pending``, the previous layer's output still to be
        added (None at the first layer); returns this layer's ``(h, pending)``. Each add is fused
        with the norm after it (``SmallOps.add_norm``)."""
        h, x = self.ops.add_norm(h, pending, self.input_layernorm)
        attn = self.self_attn(x, cos, sin, backend)
        if self.sandwich:
            h, x = self.ops.add_norm(h, self.ops.norm(attn, self.post_attention_layernorm), self.pre_feedforward_layernorm)
            return h, self.ops.norm(self.mlp(x), self.post_feedforward_layernorm)
        h, x = self.ops.add_norm(h, attn, self.post_attention_layernorm)
        return h, self.mlp(x)


class Decoder(nn.Module):
    """Embeddings, the decoder layers, the final norm and the LM head."""

    def __init__(self, spec: ModelSpec, weights: WeightSource, activation_dtype: ActivationDtype,
                 placement: Placement = CPU) -> None:
        """``placement``: where ``load_model`` puts the model and which kernels its Linears took
        (the engine follows it: its cache, metadata and attention backend)."""
        super().__init__()
        self.spec = spec
        self.placement = placement
        self.activation_dtype = activation_dtype  # the dtype and why it was chosen
        self.cpu_kernels: CpuKernelChoice | None = None  # set by load_model on the CPU
        self.dtype = dtype = activation_dtype.dtype
        embed = weights.tensor("model.embed_tokens.weight").to(dtype)
        self.register_buffer("embed_tokens", embed, persistent=False)
        embed_scale = None
        if spec.embed_scale is not None:  # as transformers: the scale rounded to the weight dtype
            embed_scale = torch.tensor(spec.embed_scale).to(dtype)
        self.register_buffer("embed_scale", embed_scale, persistent=False)
        ropes = sorted(set(spec.rope), key=spec.rope.index)
        self.rotary = nn.ModuleList(RotaryEmbedding(r, spec.head_dim, spec.max_position_embeddings) for r in ropes)
        self.rope_of_layer = [ropes.index(r) for r in spec.rope]
        self.ops = SmallOps(fused=placement.kernels == "triton")
        self.layers = nn.ModuleList(DecoderLayer(spec, i, weights, dtype, self.ops) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_offset)
        final = weights.tensor("model.norm.weight")
        self.norm.weight.data = final.float() if spec.norm_offset else final.to(dtype)
        self.lm_head = None if spec.tie_word_embeddings else weights.linear("lm_head", False)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions ``int64 [T]`` -> final-normed hidden ``[T, hidden]`` in the model dtype."""
        h = F.embedding(input_ids, self.embed_tokens)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        cos_sin = [r(positions, self.dtype) for r in self.rotary]
        share = getattr(backend, "share_rotary", None)  # one cos/sin per step for queries and keys
        if share is not None:
            share({(r.key_rope, self.dtype): cs for r, cs in zip(self.rotary, cos_sin)})
        pending = None
        for i, layer in enumerate(self.layers):
            cos, sin = cos_sin[self.rope_of_layer[i]]
            h, pending = layer(h, pending, cos, sin, backend)
        return self.ops.add_norm(h, pending, self.norm)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[N, hidden]`` -> fp32 logits ``[N, vocab]`` (Gemma's final softcap applied)."""
        if self.lm_head is None:
            logits = F.linear(hidden, self.embed_tokens)
        else:
            logits = self.lm_head(hidden)
        logits = logits.float()
        cap = self.spec.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
