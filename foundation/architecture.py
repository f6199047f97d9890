"""Which model families kvslim handles, read from a checkpoint's config.json."""
from __future__ import annotations

from foundation.errors import UnsupportedArchitecture

# The Linear modules of a decoder layer, as every supported family names them.
KV_PROJECTIONS = ("k_proj", "v_proj")  # absent in a layer that reads another layer's KV
QKV_PROJECTIONS = ("q_proj",) + KV_PROJECTIONS  # one input: fusable into one GEMM
ATTENTION_PROJECTIONS = QKV_PROJECTIONS + ("o_proj",)  # under self_attn
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # under mlp
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS

# model_type -> the causal-LM class transformers uses for it.
SUPPORTED: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def model_type_of(config: dict) -> str:
    """Return the config's ``model_type`` if kvslim supports it, else raise a one-line error."""
    model_type = config.get("model_type")
    if model_type == "gemma3" and isinstance(config.get("text_config"), dict):
        raise UnsupportedArchitecture(
            "architecture Gemma3ForConditionalGeneration (multimodal) is not supported; "
            "use the text-only Gemma3ForCausalLM checkpoint"
        )
    if model_type not in SUPPORTED:
        arch = ",".join(config.get("architectures") or []) or str(model_type)
        raise UnsupportedArchitecture(
            f"architecture {arch} (model_type={model_type}) is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED.values()))}"
        )
    return model_type
