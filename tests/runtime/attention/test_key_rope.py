"""Key rotation as the backends apply it, against transformers' rotary embedding."""
import torch
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama as llama

from runtime.attention.key_rope import KeyRope, StepKeyRotary, rotated_keys
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


def test_the_compiled_read_rotation_matches_its_eager_reference():
    g = torch.Generator().manual_seed(1)
    key_rope = KeyRope.of(LLAMA3, 16, 512)
    k = torch.randn(4, 128, 3, 16, generator=g)  # [S, Tk, KVH, D] as a decode read, fp32 off the cache
    positions = torch.randint(0, 512, (4, 128), generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        got = key_rope.rotate(k, positions, dtype)
        want = rotated_keys(k, positions, key_rope.inv_freq_on(k.device), key_rope.scaling, dtype)
        assert got.dtype == dtype
        tol = max(torch.finfo(dtype).eps, 2e-6)  # compiled cos/sin (vectorized) differ from libm's by ulps
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


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


def test_the_decoders_cos_sin_is_the_one_keys_rotate_by():
    """One table per step: the decoder hands its cos/sin to the backend, keyed by the KeyRope the
    layers' attention params carry, and the step's keys rotate by those very tensors."""
    from runtime.model.layers.rotary import RotaryEmbedding

    emb = RotaryEmbedding(LLAMA3, 16, 512)
    assert emb.key_rope == KeyRope.of(LLAMA3, 16, 512)
    positions = torch.tensor([3, 9])
    cos, sin = emb(positions, torch.float32)
    seen = []
    rotary = StepKeyRotary(positions, lambda k, c, s: seen.append((c, s)) or k)
    rotary.share({(emb.key_rope, torch.float32): (cos, sin)})
    rotary(KeyRope.of(LLAMA3, 16, 512), torch.randn(2, 2, 16))
    assert seen[0][0] is cos and seen[0][1] is sin


def test_an_engine_step_computes_the_keys_cos_sin_nowhere_else(tiny_llama, monkeypatch):
    from runtime.attention import key_rope
    from runtime.engine.engine import Engine, EngineConfig
    from runtime.engine.sampling import SamplingParams
    from runtime.model.loader import load_model

    engine = Engine(load_model(tiny_llama, "float32"), EngineConfig(max_num_batched_tokens=64, max_model_len=96,
                                                                    kv_cache_bytes=2 << 20))
    calls = []
    real = key_rope.rotary_cos_sin
    monkeypatch.setattr(key_rope, "rotary_cos_sin", lambda *a: calls.append(1) or real(*a))
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0))
    assert calls == []
