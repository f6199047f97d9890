"""The compiled KV reads against their eager reference (the same math, run op by op)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

from runtime.cache import compiled_kv_read
from runtime.cache.low_bit_kv import packed_dim
from runtime.cache.compiled_kv_read import (EAGER_ENV, CompiledOnCpu, _packed_keys, _packed_values, read_packed_keys,
                                            read_packed_values, read_rows)
from runtime.cache.kv_quant import quantize_per_token_head
from runtime.cache.paged_rows import gather_blocks
from tests.benchmark_scripts import load_benchmark

NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM = 24, 64, 3, 64


def _blocks(bits: int, per_token: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, packed_dim(HEAD_DIM, bits))
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    params = (NUM_BLOCKS, BLOCK, KV_HEADS) if per_token else (NUM_BLOCKS, KV_HEADS, HEAD_DIM)
    scale = torch.rand(params, generator=g).to(torch.float16)
    lo = torch.randn(params, generator=g).to(torch.float16)
    return codes, scale, lo


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    # One rounding to the output dtype either way; a fused multiply-add may round the fp32 step once less.
    tol = torch.finfo(want.dtype).eps
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_key_read_matches_eager(bits: int, dtype: torch.dtype) -> None:
    codes, scale, lo = _blocks(bits, per_token=False, seed=bits)
    blocks = torch.tensor([5, 0, 23, 7, 7, 11])  # out of order, one twice
    with torch.inference_mode():
        got = read_packed_keys(codes, scale, lo, blocks, bits, dtype)
    assert not read_packed_keys.failed
    assert got.shape == (6, BLOCK, KV_HEADS, HEAD_DIM) and got.dtype == dtype
    _assert_same(got, _packed_keys(codes, scale, lo, blocks, bits, dtype))


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_value_read_matches_eager(bits: int, dtype: torch.dtype) -> None:
    codes, scale, lo = _blocks(bits, per_token=True, seed=10 + bits)
    for blocks in (torch.tensor([3, 1, 20]), torch.arange(NUM_BLOCKS).flip(0)):  # one compiled graph, two sizes
        got = read_packed_values(codes, scale, lo, blocks, bits, dtype)
        assert not read_packed_values.failed
        _assert_same(got, _packed_values(codes, scale, lo, blocks, bits, dtype))


@pytest.mark.parametrize("store", [torch.float8_e4m3fn, torch.int8])
def test_compiled_row_read_matches_eager(store: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(NUM_BLOCKS * 16, KV_HEADS, HEAD_DIM, generator=g) * 4
    codes, scale = quantize_per_token_head(x, store)
    cache, scale = codes.view(NUM_BLOCKS, 16, KV_HEADS, HEAD_DIM), scale.view(NUM_BLOCKS, 16, KV_HEADS)
    table = torch.tensor([[4, 9, 1], [0, 23, 2]])  # [seqs, blocks]
    got = read_rows(cache, scale, table, torch.bfloat16)
    assert not read_rows.failed and got.shape == (2, 3 * 16, KV_HEADS, HEAD_DIM)
    _assert_same(got, gather_blocks(cache, scale, table, torch.bfloat16))
    static = torch.tensor(0.05)  # one calibrated scale per layer (--kv-cache-fp8)
    _assert_same(read_rows(cache, static, table, torch.float32), gather_blocks(cache, static, table, torch.float32))


def test_a_failed_compile_warns_once_and_reads_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler\nmore detail")
        return run

    monkeypatch.setattr(compiled_kv_read.torch, "compile", broken)
    read = CompiledOnCpu(_packed_keys, size_arg=3)
    codes, scale, lo = _blocks(4, per_token=False, seed=0)
    blocks = torch.tensor([1, 2, 3])
    with pytest.warns(RuntimeWarning, match=r"KV reads run eagerly: compiling them failed \(RuntimeError: no C"):
        got = read(codes, scale, lo, blocks, 4, torch.bfloat16)
    assert read.failed
    torch.testing.assert_close(got, _packed_keys(codes, scale, lo, blocks, 4, torch.bfloat16), rtol=0, atol=0)
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        read(codes, scale, lo, blocks, 4, torch.bfloat16)
    assert not later


def test_eager_when_asked_and_for_a_single_block(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(fn, **kwargs):
        raise AssertionError("compiled although eager was asked")

    monkeypatch.setattr(compiled_kv_read.torch, "compile", never)
    read = CompiledOnCpu(_packed_keys, size_arg=3)
    codes, scale, lo = _blocks(4, per_token=False, seed=1)
    read(codes, scale, lo, torch.tensor([4]), 4, torch.float32)
    monkeypatch.setenv(EAGER_ENV, "1")
    read(codes, scale, lo, torch.tensor([4, 5, 6]), 4, torch.float32)
    assert read.compiled is None and not read.failed


def test_the_read_benchmark_checks_and_writes_every_row(tmp_path) -> None:
    out = tmp_path / "read.json"
    args = ["--seqs", "2", "--context", "200", "--reps", "1", "--dtypes", "int4", "int2", "--json", str(out)]
    assert load_benchmark("cpu_kv_read").main(args) == 0
    (case,) = json.loads(out.read_text())["cases"]
    assert list(case["ms"]) == ["bf16, gathered", "int4, eager", "int4, compiled", "int2, eager", "int2, compiled"]
