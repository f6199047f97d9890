import pytest
import torch

from attention_variants.convert import ConvertSpec
from attention_variants.head_alignment import align_kv_heads, similarity_groups
from attention_variants.projections import complex_pairs, fold_into_query, proj_key, real_rows
from tests.attention_variants.helpers import config_of, convert_tiny, edit_checkpoint, logits, random_calibration
from tests.tiny_models import make_tiny_checkpoint

IDS = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_alignment_leaves_the_unmerged_model_unchanged(tmp_path, arch):
    """Grouping (a permutation of KV heads with their readers) and alignment (rotations folded into
    the readers) before any merge: the same function, within fp32 tolerance."""
    src = make_tiny_checkpoint(tmp_path / "src", arch, num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    inputs = random_calibration(src)
    config = config_of(src)
    aligned = edit_checkpoint(src, tmp_path / "aligned", lambda w: w.update(
        align_kv_heads(w, config, 2, [inputs.flat(layer) for layer in range(4)])))
    torch.testing.assert_close(logits(aligned, IDS), logits(src, IDS), atol=1e-4, rtol=1e-4)


def _rotated_copies(weights):
    """2 KV heads (A, B) read by query heads (0, 1) and (2, 3) become 4 KV heads [A, B, A', B']
    read by 0, 2, 1, 3, where A' and B' are A and B rotated (V by an orthogonal matrix, K by a
    phase per rotary pair) and their readers compensate: the same function, with heads to find."""
    g = torch.Generator().manual_seed(3)
    d = 32
    for layer in range(4):
        q, k, v, o = (weights[proj_key(layer, p)].double() for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
        qh, kh, vh = q.reshape(4, d, -1), k.reshape(2, d, -1), v.reshape(2, d, -1)
        oh = o.reshape(o.shape[0], 4, d)
        new_k, new_v, new_q, new_o = [kh[0], kh[1]], [vh[0], vh[1]], [qh[0], qh[2]], [oh[:, 0], oh[:, 2]]
        for kv, reader in ((0, 1), (1, 3)):
            rot, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
            phase = torch.polar(torch.ones(d // 2, dtype=torch.float64), torch.rand(d // 2, generator=g, dtype=torch.float64) * 6.28)
            new_v.append(rot.T @ vh[kv])
            new_o.append(oh[:, reader] @ rot)
            new_k.append(real_rows(complex_pairs(kh[kv]) * phase.unsqueeze(1)))
            new_q.append(fold_into_query(qh[reader], phase.conj()))
        weights[proj_key(layer, "k_proj")] = torch.cat(new_k).float()
        weights[proj_key(layer, "v_proj")] = torch.cat(new_v).float()
        weights[proj_key(layer, "q_proj")] = torch.cat(new_q).float()
        weights[proj_key(layer, "o_proj")] = torch.stack(new_o, dim=1).reshape(o.shape).float()


def test_rotated_copies_are_grouped_aligned_and_merged_exactly(tiny_llama, tmp_path):
    four = edit_checkpoint(tiny_llama, tmp_path / "four", _rotated_copies)
    (four / "config.json").write_text((four / "config.json").read_text().replace('"num_key_value_heads": 2', '"num_key_value_heads": 4'))
    assert config_of(four)["num_key_value_heads"] == 4
    ref = logits(tiny_llama, IDS)
    torch.testing.assert_close(logits(four, IDS), ref, atol=2e-4, rtol=1e-4)  # the construction is exact

    aligned = convert_tiny(four, tmp_path / "aligned", ConvertSpec(kv_heads=2, merge="aligned"), calibrate=True)
    torch.testing.assert_close(logits(aligned, IDS), ref, atol=2e-4, rtol=1e-4)
    mean = convert_tiny(four, tmp_path / "mean", ConvertSpec(kv_heads=2, merge="mean"))
    assert (logits(mean, IDS) - ref).abs().max() > 0.05  # consecutive heads, unaligned: far off


def test_similarity_groups_take_the_most_similar_heads_of_the_first_left():
    sim = torch.tensor([[1.0, 0.1, 0.9, 0.2], [0.1, 1.0, 0.3, 0.8], [0.9, 0.3, 1.0, 0.1], [0.2, 0.8, 0.1, 1.0]])
    assert similarity_groups(sim, 2) == [[0, 2], [1, 3]]
    assert similarity_groups(sim, 1) == [[0, 1, 2, 3]]
    assert similarity_groups(sim, 4) == [[0], [1], [2], [3]]


def test_aligned_merge_to_mqa_beats_the_plain_mean(tiny_llama, tmp_path):
    ref = logits(tiny_llama, IDS)
    mean = convert_tiny(tiny_llama, tmp_path / "mean", ConvertSpec(kv_heads=1, merge="mean"))
    aligned = convert_tiny(tiny_llama, tmp_path / "aligned", ConvertSpec(kv_heads=1, merge="aligned"), calibrate=True)
    assert (logits(aligned, IDS) - ref).pow(2).mean() < (logits(mean, IDS) - ref).pow(2).mean()
