"""`compress quantize --nf4 | --int8-bnb`: bitsandbytes checkpoints that transformers reloads,
that `compress inspect` reads, and that the kvslim runtime refuses in one line."""
from __future__ import annotations

import pytest
import torch

from compress.bnb_quantize import bnb_config, quantize_bnb
from compress.inspection import format_inspection, inspect_checkpoint
from foundation.bnb_scheme import BnbScheme
from foundation.checkpoint import Checkpoint
from foundation.errors import CheckpointError
from tests.compress.test_quantize_cli import assert_one_line_error, run_cli

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def bnb_checkpoints(tiny_llama, tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("bnb")
    return {kind: quantize_bnb(tiny_llama, root / kind, kind) for kind in ("nf4", "int8")}


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_transformers_reloads_with_bitsandbytes_linears(bnb_checkpoints, tiny_llama, kind):
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    done = bnb_checkpoints[kind]
    assert done.quantized_linears == 4 * 7 and done.bytes_after < done.bytes_before
    model = AutoModelForCausalLM.from_pretrained(done.out, dtype=torch.float32, device_map="cpu")
    expected = bnb.nn.Linear4bit if kind == "nf4" else bnb.nn.Linear8bitLt
    assert isinstance(model.model.layers[0].mlp.down_proj, expected)
    assert type(model.lm_head) is torch.nn.Linear
    # The oracle: bitsandbytes quantizing the source as transformers loads it, in memory.
    in_memory = AutoModelForCausalLM.from_pretrained(
        tiny_llama, quantization_config=bnb_config(kind, torch.float32), dtype=torch.float32, device_map="cpu")
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, in_memory(ids).logits, atol=0, rtol=0)


def test_inspect_reads_them(bnb_checkpoints):
    for kind, needle in (("nf4", "bitsandbytes NF4 (4-bit, blocks of 64)"), ("int8", "LLM.int8")):
        ins = inspect_checkpoint(bnb_checkpoints[kind].out)
        assert ins.bnb == BnbScheme.of_model_config(Checkpoint.open(bnb_checkpoints[kind].out).config)
        text = format_inspection(ins)
        assert needle in text and "vLLM (--quantization bitsandbytes)" in text and not ins.unread
        assert ins.num_params == inspect_checkpoint(bnb_checkpoints["int8"].out).num_params


def test_inspect_refuses_a_misshapen_bnb_tensor(bnb_checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    src = bnb_checkpoints["nf4"].out
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(bad / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight.absmax"
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="absmax has shape"):
        inspect_checkpoint(bad)


def test_cli_writes_and_refuses(tiny_llama, bnb_checkpoints, tmp_path, capsys):
    out = tmp_path / "q"
    rc, stdout, _ = run_cli(capsys, "quantize", str(tiny_llama), "--nf4", "--dtype", "bfloat16", "-o", str(out))
    assert rc == 0 and "bitsandbytes NF4" in stdout and "--quantization bitsandbytes" in stdout
    rc, _, err = run_cli(capsys, "quantize", str(tiny_llama), "--int8-bnb", "--method", "gptq", "-o", str(tmp_path / "x"))
    assert_one_line_error(rc, err, "--method gptq does not apply to --int8-bnb")
    rc, _, err = run_cli(capsys, "quantize", str(bnb_checkpoints["nf4"].out), "--int4", "-o", str(tmp_path / "y"))
    assert_one_line_error(rc, err, "already quantized (bitsandbytes)")
    rc, _, err = run_cli(capsys, "generate", str(bnb_checkpoints["nf4"].out), "hello")
    assert_one_line_error(rc, err, "a bitsandbytes checkpoint loads in transformers")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_eval_hf_backend_loads_them(tiny_with_tokenizer, tmp_path):
    import bitsandbytes as bnb

    from eval.lm_eval_runner import load_hf

    done = quantize_bnb(tiny_with_tokenizer, tmp_path / "nf4", "nf4")
    model = load_hf(done.out, batch_size=1)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.lm.model.modules())
    logits = model.logits_fn(torch.tensor([[1, 2, 3, 4]]))
    assert logits.shape == (1, 4, 49152) and torch.isfinite(logits).all()
