"""`compress export --gguf`: our codes as GGML blocks, exactly; transformers reads the file back.

Oracles: gguf's own dequantization of every exported block equals our dequantization of the
checkpoint's codes (bit for bit, fp32, scales stored in bf16; Q4_1 up to its fp16 offset
``m = -(zp + 8) * scale``, a product fp16 may round by half an ulp); transformers loading the GGUF
(``gguf_file=``) gives the logits of the checkpoint loaded through compressed-tensors (fixed
before measuring: 1e-5 absolute, the same dense fp32 weights through the same modeling code).
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from cli.main import main
from compress.gguf_blocks import encode_blocks, exact_type_for
from compress.gguf_export import export_gguf, llama_row_order
from compress.quantize import quantize_checkpoint
from foundation.checkpoint import Checkpoint
from foundation.errors import KvslimError
from foundation.primitives import dequantize_linear
from foundation.schemes import FP8_W8A16, W4A16, W8A16

LOGITS_ATOL = 1e-5
SCHEMES = {
    "int8": W8A16,
    "int4_sym": W4A16.with_options(group_size=32, symmetric=True),
    "int4_asym": W4A16.with_options(group_size=32, symmetric=False),
    "int4_g64_sym": W4A16.with_options(group_size=64, symmetric=True),
}


@pytest.fixture(scope="module")
def quantized(tiny_with_tokenizer, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {name: quantize_checkpoint(tiny_with_tokenizer, root / name, scheme, progress=False,
                                      dtype=torch.bfloat16).out for name, scheme in SCHEMES.items()}


def _gguf_weights(path: Path) -> dict[str, tuple[str, torch.Tensor]]:
    reader = gguf.GGUFReader(str(path))
    return {t.name: (t.tensor_type.name, torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()))
            for t in reader.tensors}


@pytest.mark.parametrize("gguf_type", ["q8_0", "q4_0", "q4_1"])
def test_blocks_hold_codes_exactly(gguf_type):
    torch.manual_seed(0)
    scheme = W4A16.with_options(group_size=32, symmetric=gguf_type != "q4_1")
    q = torch.randint(-8, 8, (6, 64), dtype=torch.int8)
    scale = torch.rand(6, 2, dtype=torch.float32).to(torch.bfloat16)
    zp = None if scheme.symmetric else torch.randint(-8, 8, (6, 2), dtype=torch.int8)
    enc = encode_blocks(q, scale, zp, scheme, gguf_type)
    ours = (q.float() - (zp.float().repeat_interleave(32, 1) if zp is not None else 0)) * scale.float().repeat_interleave(32, 1)
    theirs = torch.from_numpy(gguf.quants.dequantize(enc.data, gguf.GGMLQuantizationType[gguf_type.upper()]).copy())
    assert enc.max_scale_rel_change == 0.0
    _assert_same(theirs, ours, scale, enc.max_offset_rel_change)


def _assert_same(theirs: torch.Tensor, ours: torch.Tensor, scale: torch.Tensor, offset_change: float) -> None:
    """Bit for bit, except Q4_1's rounded offset (at most 2**-11 relative, |m| <= 16 scales)."""
    if offset_change == 0.0:
        assert torch.equal(theirs, ours)
        return
    assert offset_change <= 2 ** -11
    torch.testing.assert_close(theirs, ours, atol=16 * scale.float().abs().max().item() * 2 ** -11, rtol=0)


def test_exact_type_for_each_scheme():
    assert exact_type_for(SCHEMES["int8"]) == "q8_0"
    assert exact_type_for(SCHEMES["int4_sym"]) == "q4_0"
    assert exact_type_for(SCHEMES["int4_asym"]) == "q4_1"
    assert exact_type_for(W4A16.with_options(group_size=16)) is None
    assert exact_type_for(FP8_W8A16) is None
    assert exact_type_for(W8A16.with_options(group_size=32, symmetric=False)) is None


@pytest.mark.parametrize("name", list(SCHEMES))
def test_round_trip_is_exact(quantized, tmp_path, name):
    out = tmp_path / "m.gguf"
    done = export_gguf(quantized[name], out)
    assert done.count("requantized") == 0 and done.count("gguf-quantized") == 0
    assert done.max_scale_rel_change == 0.0
    weights = _gguf_weights(out)
    ckpt = Checkpoint.open(quantized[name])
    config = ckpt.config
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for plan in done.tensors:
        if plan.source != "exact":
            continue
        tensors = {n.rsplit(".", 1)[-1]: ckpt.get(n) for n in ckpt.names() if n.startswith(plan.name + ".")}
        ours = dequantize_linear({**tensors, "weight_scale": tensors["weight_scale"].float()}, plan.scheme)
        proj = plan.name.rsplit(".", 1)[-1]
        if proj in heads:
            ours = llama_row_order(ours, heads[proj])
        gguf_type, theirs = weights[plan.gguf_name]
        assert gguf_type == plan.ggml_type.name
        _assert_same(theirs, ours, tensors["weight_scale"], done.max_offset_rel_change)
    assert done.count("exact") == 7 * config["num_hidden_layers"]


@pytest.mark.parametrize("name", ["int8", "int4_sym"])
def test_transformers_loads_the_file_with_the_same_logits(quantized, tmp_path, name):
    """Against transformers' default compressed-tensors route, which dequantizes in fp32 when asked
    for fp32 (``dequantize=True`` would multiply in the bf16 scales' dtype)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "m.gguf"
    export_gguf(quantized[name], out)
    ref = AutoModelForCausalLM.from_pretrained(quantized[name], dtype=torch.float32)
    got = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32)
    ids = torch.randint(0, 49152, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(got(ids).logits, ref(ids).logits, atol=LOGITS_ATOL, rtol=0)


def test_tokenizer_metadata(quantized, tmp_path):
    out = tmp_path / "m.gguf"
    export_gguf(quantized["int8"], out)
    fields = gguf.GGUFReader(str(out)).fields
    tokenizer = json.loads((quantized["int8"] / "tokenizer.json").read_text())
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    tokens = fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == 49152
    assert all(tokens[i] == t for t, i in list(tokenizer["model"]["vocab"].items())[:500])
    assert len(fields["tokenizer.ggml.merges"].contents()) == len(tokenizer["model"]["merges"])
    assert fields["llama.attention.head_count_kv"].contents() == 2


def test_unquantized_checkpoint_keeps_float_or_is_quantized_by_gguf(tiny_with_tokenizer, tmp_path):
    done = export_gguf(tiny_with_tokenizer, tmp_path / "f.gguf")
    assert {t.ggml_type.name for t in done.tensors} == {"F32"}
    done = export_gguf(tiny_with_tokenizer, tmp_path / "q.gguf", "q8_0")
    assert done.count("gguf-quantized") == 7 * 4
    weights = _gguf_weights(tmp_path / "q.gguf")
    ref = Checkpoint.open(tiny_with_tokenizer).get("model.layers.0.mlp.up_proj.weight")
    torch.testing.assert_close(weights["blk.0.ffn_up.weight"][1], ref, atol=ref.abs().max().item() / 100, rtol=0)


def test_embeddings_can_be_q8_0(quantized, tmp_path):
    done = export_gguf(quantized["int4_sym"], tmp_path / "m.gguf", embeddings="q8_0")
    kinds = {t.gguf_name: (t.ggml_type.name, t.source) for t in done.tensors}
    assert kinds["token_embd.weight"] == ("Q8_0", "gguf-quantized") == kinds["output.weight"]
    embed = Checkpoint.open(quantized["int4_sym"]).get("model.embed_tokens.weight").float()
    got = _gguf_weights(tmp_path / "m.gguf")["token_embd.weight"][1]
    torch.testing.assert_close(got, embed, atol=embed.abs().max().item() / 127, rtol=0)


def test_a_quantized_lm_head_keeps_its_codes(tiny_with_tokenizer, tmp_path):
    ckpt = quantize_checkpoint(tiny_with_tokenizer, tmp_path / "q", SCHEMES["int4_sym"], progress=False,
                               dtype=torch.bfloat16, lm_head="int8").out
    done = export_gguf(ckpt, tmp_path / "m.gguf")
    head = next(t for t in done.tensors if t.gguf_name == "output.weight")
    assert (head.ggml_type.name, head.source) == ("Q8_0", "exact")
    c = Checkpoint.open(ckpt)
    tensors = {k.removeprefix("lm_head."): c.get(k) for k in c.names() if k.startswith("lm_head.")}
    ours = dequantize_linear({**tensors, "weight_scale": tensors["weight_scale"].float()}, W8A16)
    assert torch.equal(_gguf_weights(tmp_path / "m.gguf")["output.weight"][1], ours)


def test_fp32_scales_are_rounded_and_reported(tiny_with_tokenizer, tmp_path):
    ckpt = quantize_checkpoint(tiny_with_tokenizer, tmp_path / "fp32", SCHEMES["int4_sym"], progress=False).out
    done = export_gguf(ckpt, tmp_path / "m.gguf")
    assert 0 < done.max_scale_rel_change < 2 ** -10


def _cli(*argv: str) -> int:
    return main(["export", *argv])


def test_refusals_write_nothing(quantized, tiny_with_tokenizer, tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "x.gguf"
    fp8 = quantize_checkpoint(tiny_with_tokenizer, tmp_path / "fp8", FP8_W8A16, progress=False, dtype=torch.bfloat16).out
    cases = [
        ((str(quantized["int4_asym"]), "--gguf", "q4_0"), "q4_0 cannot hold"),
        ((str(quantized["int8"]), "--gguf", "q4_1"), "--requantize"),
        ((str(fp8), "--gguf"), "FP8"),
        ((str(tiny_checkpoints["qwen2"]), "--gguf"), "Llama-architecture"),
    ]
    for argv, needle in cases:
        assert _cli(*argv, "-o", str(out)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
        assert not out.exists() and not list(tmp_path.glob(".x.gguf*"))
    assert _cli(str(fp8), "--gguf", "q8_0", "--requantize", "-o", str(out)) == 0
    assert "re-quantized by gguf" in capsys.readouterr().out
    assert _cli(str(quantized["int8"]), "--gguf", "-o", str(out)) == 2
    assert "already exists" in capsys.readouterr().err


def test_rewritten_checkpoints_are_refused(tiny_with_tokenizer, tmp_path, capsys):
    from attention_variants.convert import ConvertSpec, convert

    sliding = tmp_path / "sliding"
    convert(tiny_with_tokenizer, ConvertSpec(sliding_window=8, global_every=2), sliding)
    assert _cli(str(sliding), "--gguf", "-o", str(tmp_path / "s.gguf")) == 2
    err = capsys.readouterr().err
    assert "sliding-window" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "s.gguf").exists()


def test_unknown_pre_tokenizer_needs_a_name(quantized, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in quantized["int8"].iterdir():
        (ckpt / f.name).symlink_to(f)
    tokenizer = json.loads((quantized["int8"] / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁"}
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(KvslimError, match="--tokenizer-pre"):
        export_gguf(ckpt, tmp_path / "m.gguf")
    done = export_gguf(ckpt, tmp_path / "m.gguf", tokenizer_pre="llama-bpe")
    assert done.tokenizer_pre == "llama-bpe"
    assert np.asarray(gguf.GGUFReader(str(tmp_path / "m.gguf")).fields["tokenizer.ggml.pre"].contents()) == "llama-bpe"
