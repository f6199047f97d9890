"""runtime.model.loader refuses a misshapen checkpoint at load time, with one line naming the tensor and
both shapes: never a torch error on the first forward (`compress generate`, `compress serve`)."""
from __future__ import annotations

import socket

import pytest
import torch

from cli.main import main
from compress.quantize import quantize_checkpoint
from foundation.errors import CheckpointError
from foundation.schemes import W8A16, default_scheme
from runtime.model.loader import load_model
from tests.tiny_models import damaged_copy

DOWN = "model.layers.3.mlp.down_proj"


@pytest.fixture(scope="module")
def int8_llama(tiny_checkpoints, tmp_path_factory):
    return quantize_checkpoint(tiny_checkpoints["llama"], tmp_path_factory.mktemp("int8") / "q", W8A16,
                               progress=False).out


@pytest.fixture(scope="module")
def int4_llama(tiny_checkpoints, tmp_path_factory):
    return quantize_checkpoint(tiny_checkpoints["llama"], tmp_path_factory.mktemp("int4") / "q",
                               default_scheme("int4"), progress=False).out


def damaged(kind: str, request, tmp_path):
    """(damaged checkpoint, the message it must be refused with)."""
    if kind == "int8-rows-cut":
        src = request.getfixturevalue("int8_llama")
        return (damaged_copy(src, tmp_path / kind, put={f"{DOWN}.weight_packed": torch.zeros(125, 64, dtype=torch.int32)}),
                f"{DOWN}.weight_packed has shape [125, 64], expected [128, 64]")
    if kind == "int4-weight_shape":
        src = request.getfixturevalue("int4_llama")
        return (damaged_copy(src, tmp_path / kind, put={f"{DOWN}.weight_shape": torch.tensor([128, 200])}),
                f"{DOWN}.weight_shape holds [128, 200], expected [128, 256]")
    src = request.getfixturevalue("tiny_checkpoints")["llama"]
    if kind == "dense-columns-cut":
        return (damaged_copy(src, tmp_path / kind, put={f"{DOWN}.weight": torch.zeros(128, 100)}),
                f"{DOWN}.weight has shape [128, 100], expected [128, 256]")
    if kind == "dense-embedding":
        return (damaged_copy(src, tmp_path / kind, put={"model.embed_tokens.weight": torch.zeros(500, 128)}),
                "model.embed_tokens.weight has shape [500, 128], expected [512, 128] (embedding vocab_size x hidden_size)")
    raise AssertionError(kind)


KINDS = ["int8-rows-cut", "int4-weight_shape", "dense-columns-cut", "dense-embedding"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_model_refuses_misshapen_tensors(kind, dtype, request, tmp_path):
    path, needle = damaged(kind, request, tmp_path)
    with pytest.raises(CheckpointError) as err:
        load_model(path, dtype)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("kind", KINDS)
def test_generate_refuses_with_one_line(kind, request, tmp_path, capsys):
    path, needle = damaged(kind, request, tmp_path)
    assert main(["generate", str(path), "Hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_serve_refuses_at_startup(request, tmp_path, capsys):
    path, needle = damaged("int8-rows-cut", request, tmp_path)
    (path / "tokenizer_config.json").write_text("{}")  # the server checks for a tokenizer first
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["serve", str(path), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_intact_quantized_and_kv_shared_checkpoints_still_load(int8_llama, int4_llama, tiny_checkpoints, tmp_path):
    load_model(int8_llama)
    load_model(int4_llama, "bfloat16")
    shared = tmp_path / "shared"
    assert main(["convert", str(tiny_checkpoints["qwen3"]), "--mqa", "--merge", "mean", "--kv-share", "2",
                 "--eval-tokens", "0", "-o", str(shared)]) == 0
    model = load_model(shared)
    assert model.layers[1].self_attn.k_norm is None  # a reader: its own k_norm is carried but unused
    quantize_checkpoint(shared, tmp_path / "q", W8A16, progress=False)
    load_model(tmp_path / "q")


def test_untied_model_without_lm_head_is_refused(tiny_checkpoints, tmp_path):
    path = damaged_copy(tiny_checkpoints["mistral"], tmp_path / "no-head", drop=("lm_head.weight",))
    with pytest.raises(CheckpointError, match="missing tensor lm_head.weight"):
        load_model(path)
