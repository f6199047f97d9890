"""The GPU benchmark scripts: a clear one-line refusal without CUDA, and a CPU smoke run that
exercises their logic (shapes, bytes, reference checks, JSON) through the Triton interpreter
(already active in this process: tests/conftest.py sets TRITON_INTERPRET without CUDA)."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[3]


script = load_benchmark


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
@pytest.mark.parametrize("name", ["kernels_roofline", "paged_attention_bench"])
def test_without_cuda_the_scripts_exit_with_one_line(name, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert script(name).main(["--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and "CUDA" in captured.err
    assert not out.exists()


# On a CUDA machine the kernels in this process are compiled, not interpreted: smoke runs only here.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="smoke mode is the CPU interpreter's")


@cpu_only
def test_paged_attention_bench_smoke(tmp_path):
    out = tmp_path / "pa.json"
    assert script("paged_attention_bench").main(["--smoke", "--kv", "int8/token", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["phase"] for r in rows} == {"decode", "prefill"} and all(r["ok"] for r in rows)
    decode = next(r for r in rows if r["phase"] == "decode")
    # 2 sequences x 40 tokens x K and V x 2 KV heads x (16 int8 + a 4-byte scale)
    assert decode["kv_bytes"] == 2 * 40 * 2 * 2 * (16 + 4)


@cpu_only
def test_kernels_roofline_smoke(tmp_path):
    out = tmp_path / "roof.json"
    args = ["--smoke", "--schemes", "bf16,w4a16-g128-asym", "--batches", "1", "--out", str(out)]
    assert script("kernels_roofline").main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["scheme"], r["M"]) for r in rows] == [("bf16", 1), ("w4a16-g128-asym", 1)]
    # K=192 is not a multiple of 128: group 64. Packed int4 (64x192/2) + bf16 scales (64x3)
    # + packed zero points (8x3 int32) + x + out (fp32 in smoke)
    assert rows[1]["group"] == 64
    assert rows[1]["bytes"] == 64 * 96 + 64 * 3 * 2 + 8 * 3 * 4 + 192 * 4 + 64 * 4
    assert all(r["ok"] for r in rows)


def test_kv_quant_peer_counts_what_quantized_cache_allocates(monkeypatch):
    pytest.importorskip("optimum.quanto")
    from types import SimpleNamespace

    from transformers import LlamaConfig

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)  # the script sets a default; restored after
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as running the script makes it importable
    spec = importlib.util.spec_from_file_location("kv_quant_peer", ROOT / "benchmarks" / "kv_quant_peer.py")
    peer = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kv_quant_peer", peer)  # its dataclasses look their module up there
    spec.loader.exec_module(peer)
    qc = sys.modules["quantized_cache_peer"]  # the transformers side, imported by the script
    assert peer.split_at_blocks(qc.window_chunks(130, 64, 64), 64) == [63, 1, 63, 1, 2]
    config = LlamaConfig(num_hidden_layers=2, hidden_size=192, num_attention_heads=3, num_key_value_heads=3)
    kv = [torch.randn(1, 3, 64, 64) for _ in range(4)]
    for residual, quantized in ((64, 128), (128, 64)):
        cache = qc.quantized_cache_factory(SimpleNamespace(config=config), "quanto", 4, residual, 64)()
        for layer in range(2):
            cache.update(kv[0], kv[1], layer)
            cache.update(kv[2], kv[3], layer)
        b = qc.cache_bytes(cache)
        assert (b.tokens, b.quantized_tokens) == (128, quantized)
        # per layer, K and V: 4-bit codes; fp32 scale + shift per channel and 64 tokens (K), per token and head (V)
        assert b.codes == 2 * 2 * quantized * 3 * 64 // 2
        assert b.params == 2 * 2 * (quantized * 3 // 64 * 64 + quantized * 3) * 4
        assert b.residual == 2 * 2 * (128 - quantized) * 3 * 64 * 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_gpu_decode_without_cuda_is_one_line(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert script("gpu_decode").main(["--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CUDA" in err and not out.exists()


def test_gpu_decode_random_checkpoint_loads_and_reports():
    """The 8B-shaped model exists only as shapes: the loader builds it (here 1 layer of a small
    config) and the tables read the rows as the script writes them."""
    from runtime.model.loader import load_model

    gpu_decode = script("gpu_decode")
    config = {**gpu_decode.LLAMA3_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300}
    model = load_model(gpu_decode.RandomCheckpoint(config).ckpt, "float32")
    hidden = model(torch.tensor([1, 2, 3]), torch.arange(3), _NoAttention())
    assert hidden.shape == (3, 64) and torch.isfinite(hidden).all()

    class Ref:  # what HF generate returns with scores: 2 prompts, 3 new tokens
        sequences = torch.tensor([[9, 1, 2, 3], [9, 4, 5, 6]])
        scores = [torch.tensor([[1.0, 0.0, 0.99], [0.0, 2.0, 0.0]])] * 3

    a = gpu_decode.agreement([[1, 2, 3], [4, 7, 6]], Ref)
    assert [p["agree"] for p in a["prompts"]] == [3, 1] and a["prompts"][1]["fp32_top2_gap_where_parted"] == 2.0
    assert not a["parted_only_at_near_ties"]
    doc = {"rows": {"HF static cache + compile bf16": {1: {"tok_s": 100.0}}, "kvslim CUDA graphs bf16": {1: {"tok_s": 150.0}}},
           "greedy_vs_fp32": {"kvslim CUDA graphs bf16": a},
           "kv_rows": {"bf16": {"decode_tok_s": 10.0, "capacity_seqs": 32, "cuda_graphs": True},
                       "int4": {"decode_tok_s": 15.0, "capacity_seqs": 110, "cuda_graphs": False}}}
    text = gpu_decode.table(doc)
    assert "| kvslim CUDA graphs bf16 | 150.0 (1.50x) | 3 1 |" in text and "| int4 | 15.0 | 1.50x | 110 | eager |" in text


class _NoAttention:
    def attend(self, layer_idx, q, k, v):
        return torch.zeros_like(q)
