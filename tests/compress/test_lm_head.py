"""`compress quantize --lm-head int8|int4|bf16`: the output projection stored on its own.

Oracles: transformers loads the checkpoint through compressed-tensors (default route: a name
target outranks the class ``Linear``) and its logits equal the kvslim runtime's at fp32 (fixed
before measuring: 1e-4, as tests/runtime/model/layers/test_linear.py); a tied source is untied
with the embedding's exact copy, quantized."""
from __future__ import annotations

import json

import pytest
import torch

from compress.quantize import LM_HEAD_SCHEMES, quantize_checkpoint
from foundation.checkpoint import Checkpoint
from foundation.primitives import dequantize_linear
from foundation.quant_spec import QuantSpec
from foundation.schemes import W4A16
from runtime.model.loader import load_model
from tests.compress.test_quantize_cli import assert_one_line_error, run_cli
from tests.runtime.hf_oracle import hf_logits, hf_model, runtime_logits
from tests.tiny_models import make_tiny_checkpoint

SCHEME = W4A16.with_options(group_size=32)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tied") / "m", "llama", tie_word_embeddings=True)


@pytest.mark.parametrize("head", ["int8", "int4"])
def test_tied_head_is_untied_and_quantized(tied, tmp_path, head):
    out = quantize_checkpoint(tied, tmp_path / head, SCHEME, progress=False, lm_head=head).out
    ckpt = Checkpoint.open(out)
    assert ckpt.config["tie_word_embeddings"] is False
    qc = ckpt.quantization_config
    assert "lm_head" not in qc["ignore"] and qc["config_groups"]["group_1"]["targets"] == ["lm_head"]
    spec = QuantSpec.of_model_config(ckpt.config)
    assert spec.scheme_for("lm_head") == LM_HEAD_SCHEMES[head] and spec.scheme_for("model.layers.0.mlp.up_proj") == SCHEME
    tensors = {k.removeprefix("lm_head."): ckpt.get(k) for k in ckpt.names() if k.startswith("lm_head.")}
    embed = Checkpoint.open(tied).get("model.embed_tokens.weight")
    head_weight = dequantize_linear(tensors, LM_HEAD_SCHEMES[head])
    assert (head_weight - embed).abs().max() <= tensors["weight_scale"].max()  # within one quantization step
    ids = torch.randint(0, 512, (24,), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(hf_model(out), ids)
    got = runtime_logits(load_model(out, "float32"), ids, (10,))
    assert (got - ref).abs().max().item() <= 1e-4


def test_bf16_head_is_an_untied_copy(tied, tmp_path):
    out = quantize_checkpoint(tied, tmp_path / "bf16", SCHEME, progress=False, lm_head="bf16").out
    ckpt = Checkpoint.open(out)
    assert ckpt.config["tie_word_embeddings"] is False and "lm_head" in ckpt.quantization_config["ignore"]
    head = ckpt.get("lm_head.weight")
    assert head.dtype == torch.bfloat16
    assert torch.equal(head, Checkpoint.open(tied).get("model.embed_tokens.weight").to(torch.bfloat16))


def test_untied_source_head_is_replaced_not_duplicated(tiny_llama, tmp_path):
    out = quantize_checkpoint(tiny_llama, tmp_path / "q", SCHEME, progress=False, lm_head="int8").out
    names = Checkpoint.open(out).names()
    assert "lm_head.weight" not in names and "lm_head.weight_packed" in names


def test_cli_flag_and_refusals(tied, tmp_path, capsys):
    out = tmp_path / "cli"
    rc, stdout, _ = run_cli(capsys, "quantize", str(tied), "--int4", "--lm-head", "int8", "-o", str(out), "--no-progress")
    assert rc == 0 and json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert "lm_head: int8 as its own group; the source ties it to the embedding, so the output carries an untied copy" in stdout
    rc, stdout, _ = run_cli(capsys, "inspect", str(out))
    assert rc == 0 and "lm_head: W8A16" in stdout
    rc, _, err = run_cli(capsys, "quantize", str(tied), "--int4", "--lm-head", "int8", "--ignore",
                         "model.layers.0.mlp.up_proj", "-o", str(tmp_path / "x"))
    assert_one_line_error(rc, err, "keep lm_head in --ignore")
    rc, _, err = run_cli(capsys, "quantize", str(tied), "--nf4", "--lm-head", "int8", "-o", str(tmp_path / "y"))
    assert_one_line_error(rc, err, "--lm-head does not apply to --nf4")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
