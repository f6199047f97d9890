import pytest
import torch

from attention_variants.convert import ConvertSpec
from attention_variants.sliding import global_layers_every
from foundation.attention_layout import FULL, SLIDING
from tests.attention_variants.helpers import config_of, convert_tiny, logits

IDS = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_window_larger_than_sequence_changes_nothing(tiny_checkpoints, tmp_path, arch):
    src = tiny_checkpoints[arch]
    out = convert_tiny(src, tmp_path / "w64", ConvertSpec(sliding_window=64, global_every=2))
    config = config_of(out)
    assert config["layer_types"] == [SLIDING, FULL, SLIDING, FULL] and config["sliding_window"] == 64
    assert ("auto_map" in config) == (arch == "llama")  # Qwen2 honours layer_types natively
    torch.testing.assert_close(logits(out, IDS), logits(src, IDS), atol=1e-5, rtol=1e-5)


def test_window_shorter_than_sequence_changes_only_late_tokens(tiny_llama, tmp_path):
    out = convert_tiny(tiny_llama, tmp_path / "w8", ConvertSpec(sliding_window=8, global_layers=(3,)))
    assert config_of(out)["layer_types"] == [SLIDING, SLIDING, SLIDING, FULL]
    new, ref = logits(out, IDS), logits(tiny_llama, IDS)
    torch.testing.assert_close(new[:, :8], ref[:, :8], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(new[:, 8:], ref[:, 8:], atol=1e-3)


def test_calibrated_global_layers(tiny_llama, tmp_path):
    out = convert_tiny(tiny_llama, tmp_path / "cal", ConvertSpec(sliding_window=16, global_every=2, global_select="calib"),
                       calibrate=True)
    assert config_of(out)["layer_types"].count(FULL) == 2


def test_one_global_layer_in_g():
    assert global_layers_every(30, 6) == [5, 11, 17, 23, 29]
