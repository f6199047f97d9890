import json

import pytest

from foundation.architecture import model_type_of
from foundation.errors import KvslimError, UnsupportedArchitecture
from foundation.model_source import resolve_model


def test_directory_passes_through(tiny_llama):
    assert resolve_model(tiny_llama) == tiny_llama


def test_missing_path_and_wrong_file_type(tmp_path):
    with pytest.raises(KvslimError, match="no such file"):
        resolve_model(tmp_path / "missing")
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(KvslimError, match="expected a checkpoint directory or a .gguf"):
        resolve_model(f)


def test_truncated_gguf_is_a_clear_error(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF\x03\x00")
    with pytest.raises(KvslimError, match="cannot read GGUF"):
        resolve_model(f)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", "gemma3_text"])
def test_supported_architectures(model_type):
    assert model_type_of({"model_type": model_type}) == model_type


def test_unsupported_architecture_names_it():
    with pytest.raises(UnsupportedArchitecture, match="GPT2LMHeadModel"):
        model_type_of({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UnsupportedArchitecture, match="multimodal"):
        model_type_of({"model_type": "gemma3", "text_config": {}})


@pytest.mark.slow
def test_default_model_matches_its_card(default_model_dir):
    config = json.loads((default_model_dir / "config.json").read_text())
    assert model_type_of(config) == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]) == (30, 576, 9)
    assert config["num_key_value_heads"] == 3 and config["vocab_size"] == 49152
    assert (default_model_dir / "tokenizer.json").is_file()
