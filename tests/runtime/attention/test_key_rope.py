"""Key rotation as the backends apply it, against transformers' rotary embedding."""
import torch
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as llama

from runtime.attention.key_rope import KeyRope, StepKeyRotary
from runtime.model.spec import RopeSpec

LLAMA3 = RopeSpec("llama3", 10000.0, (("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                                       ("original_max_position_embeddings", 64)))


def hf_rotated(rope: RopeSpec, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """k ``[T, KVH, D]`` rotated by transformers' Llama rotary embedding."""
    d = k.shape[-1]
    cfg = LlamaConfig(hidden_size=d, num_attention_heads=1, head_dim=d, max_position_embeddings=512,
                      rope_parameters=rope.as_dict())
    cos, sin = llama.LlamaRotaryEmbedding(cfg)(k, positions[None])
    kt = k.transpose(0, 1)[None]  # [1, KVH, T, D]
    _, rotated = llama.apply_rotary_pos_emb(kt, kt, cos, sin)
    return rotated[0].transpose(0, 1)


def test_cached_keys_rotate_as_transformers():
    g = torch.Generator().manual_seed(0)
    for rope in (RopeSpec("default", 10000.0), LLAMA3):
        k = torch.randn(300, 3, 16, generator=g)
        positions = torch.arange(300)
        key_rope = KeyRope.of(rope, 16, 512)
        torch.testing.assert_close(key_rope.rotate(k, positions), hf_rotated(rope, k, positions), rtol=1e-5, atol=1e-5)
        # batched positions [S, Tk], as a decode read
        torch.testing.assert_close(key_rope.rotate(k.view(3, 100, 3, 16), positions.view(3, 100)).view(300, 3, 16),
                                   key_rope.rotate(k, positions))


def test_the_steps_keys_rotate_as_the_decoders_queries():
    """A layout that rotates on write must store exactly what the decoder rotated before keys moved
    into the backend: cos/sin rounded to the keys' dtype, then the rotation in that dtype."""
    from runtime.attention.key_rope import apply_rotary
    from runtime.model.layers.rotary import RotaryEmbedding

    k = torch.randn(7, 2, 16).bfloat16()
    positions = torch.tensor([0, 1, 2, 40, 41, 300, 301])
    cos, sin = RotaryEmbedding(LLAMA3, 16, 512)(positions, torch.bfloat16)
    rotary = StepKeyRotary(positions)
    key_rope = KeyRope.of(LLAMA3, 16, 512)
    assert torch.equal(rotary(key_rope, k), apply_rotary(k, cos, sin))
    assert rotary(None, k) is k
