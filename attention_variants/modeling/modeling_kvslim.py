"""kvslim modeling file, carried inside converted checkpoints (``auto_map``, ``trust_remote_code``).

Adds to transformers' Llama / Mistral / Qwen2 / Qwen3 (and Gemma 3: sinks and streaming heads) what
their configs cannot express:

- ``layer_types`` + ``sliding_window`` per layer (hybrid local/global attention) for every family;
- ``num_sink_tokens`` S: sliding layers also attend to the first S tokens (attention sinks), so
  their cache keeps every token (a DynamicCache's sliding layers are swapped for full ones);
- ``kv_source_layers``: layer ``i`` attends with the (rotated, cached) K/V of layer
  ``kv_source_layers[i]``; a reader layer has no ``k_proj`` / ``v_proj`` and stores no cache;
- ``streaming_heads`` ``{"window": W, "sinks": S, "kv_heads": [[h, ...] per layer]}``: the listed
  KV heads of a layer (DuoAttention's streaming heads) and their query heads attend to the first S
  and the last W tokens only: one mask per head (the cache keeps every token).

Self-contained on purpose (it travels with checkpoints): imports only torch and transformers.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

# transformers 5.2x renamed the cache argument ``past_key_values`` to ``cache`` (the old name is
# still accepted, with a warning, by its own modules); this file speaks whichever it finds.
CACHE_ARG = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
_OUTPUT_CACHE = "cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)} else "past_key_values"

KV_SOURCE_KEY = "kv_source_layers"
SINKS_KEY = "num_sink_tokens"
STREAMING_KEY = "streaming_heads"
SLIDING = "sliding_attention"
FULL = "full_attention"


def _layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:
        kind = SLIDING if getattr(config, "sliding_window", None) is not None else FULL
        types = [kind] * config.num_hidden_layers
    return list(types)


def _kv_sources(config) -> list[int]:
    return list(getattr(config, KV_SOURCE_KEY, None) or range(config.num_hidden_layers))


def _sinks(config) -> int:
    return int(getattr(config, SINKS_KEY, None) or 0)


def _streaming(config) -> dict | None:
    value = getattr(config, STREAMING_KEY, None)
    return value if value and any(value["kv_heads"]) else None


def _every_key(batch_idx, head_idx, q_idx, kv_idx):
    return kv_idx >= 0


def per_head_mask(full: torch.Tensor, streaming: torch.Tensor, streaming_kv_heads, num_heads: int,
                  num_kv_heads: int) -> torch.Tensor:
    """``[B, H, Tq, Tk]``: ``streaming``'s mask for the query heads of ``streaming_kv_heads``,
    ``full``'s for the others (both ``[B, 1, Tq, Tk]``, boolean or additive)."""
    rep = num_heads // num_kv_heads
    heads = torch.zeros(num_kv_heads, dtype=torch.bool, device=full.device)
    heads[list(streaming_kv_heads)] = True
    return torch.where(heads.repeat_interleave(rep).view(1, -1, 1, 1), streaming, full)


def sink_window_overlay(window: int, sinks: int):
    """Mask function: key within the last ``window`` positions of the query, or among the first ``sinks``."""

    def inner(batch_idx, head_idx, q_idx, kv_idx):
        return (q_idx - kv_idx < window) | (kv_idx < sinks)

    return inner


def _check_sinks_backend(config) -> None:
    """Sinks live in the attention mask; flash-attention kernels take a window, not a mask."""
    if "flash" in str(getattr(config, "_attn_implementation", "")):
        raise ValueError("attention sinks need a masked attention implementation (sdpa or eager), not flash attention")


def streaming_layer_masks(config, streaming: dict, mask_kwargs: dict) -> dict[int, torch.Tensor]:
    """Per layer with streaming heads, its per-head mask (``create_causal_mask``'s arguments in
    ``mask_kwargs``; both masks forced to tensors by a mask function)."""
    _check_sinks_backend(config)  # per-head masks, not a kernel's window
    full = create_causal_mask(**mask_kwargs, and_mask_function=_every_key)
    local = create_causal_mask(**mask_kwargs, and_mask_function=sink_window_overlay(streaming["window"],
                                                                                    streaming["sinks"]))
    h, kvh = config.num_attention_heads, config.num_key_value_heads
    return {i: per_head_mask(full, local, heads, h, kvh) for i, heads in enumerate(streaming["kv_heads"]) if heads}


def _check_prepared_masks(attention_mask) -> None:
    """Per-head masks are built from the 2-D padding mask; masks prepared per layer type cannot carry them."""
    if isinstance(attention_mask, dict):
        raise ValueError("streaming heads build their own per-head masks: pass a 2-D attention_mask, not prepared masks")


def _keep_every_token(cache) -> None:
    """Sink layers read the first tokens forever: a fresh DynamicCache's sliding layers become full."""
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer) and not layer.is_initialized:
            cache.layers[i] = DynamicLayer()
        elif getattr(layer, "is_sliding", False):
            raise ValueError("attention sinks need a cache that keeps every token (a DynamicCache)")


class KvslimAttentionMixin:
    """Attention that honours a per-layer window and reads another layer's K/V when told to."""

    qk_norm: bool = False  # Qwen3 normalises q and k per head before rotary

    def setup_kvslim(self, config, layer_idx: int) -> None:
        self.kv_source = _kv_sources(config)[layer_idx]
        self.sliding_window = config.sliding_window if _layer_types(config)[layer_idx] == SLIDING else None
        self.window_kwarg = None if _sinks(config) else self.sliding_window  # the mask carries sinks
        if self.kv_source != layer_idx:
            del self.k_proj, self.v_proj
            if self.qk_norm:
                del self.k_norm

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                past_key_values=None, shared_kv: dict | None = None, **kwargs):
        cache = cache if cache is not None else past_key_values
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape)
        if self.qk_norm:
            query = self.q_norm(query)
        query = query.transpose(1, 2)
        cos, sin = position_embeddings
        if self.kv_source == self.layer_idx:
            key = self.k_proj(hidden_states).view(hidden_shape)
            if self.qk_norm:
                key = self.k_norm(key)
            key = key.transpose(1, 2)
            value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
            query, key = modeling_llama.apply_rotary_pos_emb(query, key, cos, sin)
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)
            if shared_kv is not None:
                shared_kv[self.layer_idx] = (key, value)
        else:
            query, _ = modeling_llama.apply_rotary_pos_emb(query, query[:, :1], cos, sin)
            key, value = shared_kv[self.kv_source]
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, modeling_llama.eager_attention_forward
        )
        out, weights = interface(
            self, query, key, value, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, sliding_window=self.window_kwarg, **kwargs,
        )
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


class KvslimModelMixin:
    """Decoder stack with one mask per layer type and a per-forward store of the owners' K/V."""

    attention_class: type

    def setup_kvslim(self, config) -> None:
        for i, layer in enumerate(self.layers):
            attn = self.attention_class(config, i)
            attn.setup_kvslim(config, i)
            layer.self_attn = attn

    @merge_with_config_defaults
    @capture_outputs
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        sinks = _sinks(self.config)
        if sinks:
            _check_sinks_backend(self.config)
            if cache is not None:
                _keep_every_token(cache)
        if position_ids is None:
            past_seen = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen
            position_ids = position_ids.unsqueeze(0)
        types = _layer_types(self.config)
        masks = attention_mask
        if not isinstance(masks, dict):
            mask_kwargs = dict(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                               position_ids=position_ids, **{CACHE_ARG: cache})
            masks = {FULL: create_causal_mask(**mask_kwargs)}
            if SLIDING in types and sinks:
                overlay = sink_window_overlay(self.config.sliding_window, sinks)
                masks[SLIDING] = create_causal_mask(**mask_kwargs, and_mask_function=overlay)
            elif SLIDING in types:
                masks[SLIDING] = create_sliding_window_causal_mask(**mask_kwargs)
        layer_masks = [masks[t] for t in types]
        streaming = _streaming(self.config)
        if streaming is not None:
            _check_prepared_masks(attention_mask)
            for i, mask in streaming_layer_masks(self.config, streaming, mask_kwargs).items():
                layer_masks[i] = mask
        hidden = inputs_embeds
        position_embeddings = self.rotary_emb(hidden, position_ids)
        shared_kv: dict = {}
        for i, layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            hidden = layer(hidden, attention_mask=layer_masks[i], position_embeddings=position_embeddings,
                           position_ids=position_ids, use_cache=use_cache, shared_kv=shared_kv,
                           **{CACHE_ARG: cache}, **kwargs)
        hidden = self.norm(hidden)
        return BaseModelOutputWithPast(last_hidden_state=hidden, **{_OUTPUT_CACHE: cache if use_cache else None})


class KvslimLlamaAttention(KvslimAttentionMixin, modeling_llama.LlamaAttention):
    pass


class KvslimLlamaModel(KvslimModelMixin, modeling_llama.LlamaModel):
    attention_class = KvslimLlamaAttention

    def __init__(self, config):
        super().__init__(config)
        self.setup_kvslim(config)


class KvslimLlamaForCausalLM(modeling_llama.LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.model = KvslimLlamaModel(config)
        self.post_init()


class KvslimMistralAttention(KvslimAttentionMixin, modeling_mistral.MistralAttention):
    pass


class KvslimMistralModel(KvslimModelMixin, modeling_mistral.MistralModel):
    attention_class = KvslimMistralAttention

    def __init__(self, config):
        super().__init__(config)
        self.setup_kvslim(config)


class KvslimMistralForCausalLM(modeling_mistral.MistralForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.model = KvslimMistralModel(config)
        self.post_init()


class KvslimQwen2Attention(KvslimAttentionMixin, modeling_qwen2.Qwen2Attention):
    pass


class KvslimQwen2Model(KvslimModelMixin, modeling_qwen2.Qwen2Model):
    attention_class = KvslimQwen2Attention

    def __init__(self, config):
        super().__init__(config)
        self.setup_kvslim(config)


class KvslimQwen2ForCausalLM(modeling_qwen2.Qwen2ForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.model = KvslimQwen2Model(config)
        self.post_init()


class KvslimQwen3Attention(KvslimAttentionMixin, modeling_qwen3.Qwen3Attention):
    qk_norm = True


class KvslimQwen3Model(KvslimModelMixin, modeling_qwen3.Qwen3Model):
    attention_class = KvslimQwen3Attention

    def __init__(self, config):
        super().__init__(config)
        self.setup_kvslim(config)


class KvslimQwen3ForCausalLM(modeling_qwen3.Qwen3ForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.model = KvslimQwen3Model(config)
        self.post_init()


class KvslimGemma3TextModel(modeling_gemma3.Gemma3TextModel):
    """Gemma 3 whose sliding layers keep ``num_sink_tokens`` attention sinks, and whose full layers
    may have streaming heads: the masks (and a cache that keeps every token) are prepared here, the
    rest is transformers' own forward; a layer with streaming heads gets its per-head mask through
    a pre-hook (transformers picks masks by layer type)."""

    def __init__(self, config):
        super().__init__(config)
        self._layer_masks: dict[int, torch.Tensor] = {}
        streaming = _streaming(config)
        for i, heads in enumerate(streaming["kv_heads"] if streaming else []):
            if heads:
                self.layers[i].register_forward_pre_hook(self._mask_hook(i), with_kwargs=True)

    def _mask_hook(self, i: int):
        def hook(_module, args, kwargs):
            kwargs["attention_mask"] = self._layer_masks[i]
            return args, kwargs
        return hook

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        sinks = _sinks(self.config)
        streaming = _streaming(self.config)
        if streaming:
            _check_prepared_masks(attention_mask)
        if (sinks or streaming) and not isinstance(attention_mask, dict):
            _check_sinks_backend(self.config)
            if inputs_embeds is None:
                inputs_embeds, input_ids = self.embed_tokens(input_ids), None
            if (use_cache if use_cache is not None else self.config.use_cache) and cache is None:
                cache = DynamicCache(config=self.config)
            if cache is not None:
                _keep_every_token(cache)
            if position_ids is None:
                past_seen = cache.get_seq_length() if cache is not None else 0
                position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen).unsqueeze(0)
            mask_kwargs = dict(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                               position_ids=position_ids, **{CACHE_ARG: cache})
            if streaming:
                self._layer_masks = streaming_layer_masks(self.config, streaming, mask_kwargs)
            if sinks:
                overlay = sink_window_overlay(self.config.sliding_window, sinks)
                sliding = create_causal_mask(**mask_kwargs, and_mask_function=overlay)
            else:
                sliding = create_sliding_window_causal_mask(**mask_kwargs)
            attention_mask = {FULL: create_causal_mask(**mask_kwargs), SLIDING: sliding}
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               inputs_embeds=inputs_embeds, use_cache=use_cache, **{CACHE_ARG: cache}, **kwargs)


class KvslimGemma3ForCausalLM(modeling_gemma3.Gemma3ForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.model = KvslimGemma3TextModel(config)
        self.post_init()
