import pytest
import torch

from foundation.errors import KvslimError
from runtime.cache import kv_quant
from runtime.cache.paged_rows import gather_blocks
from runtime.kernels import kv_store as kvs
from tests.runtime.conftest import requires_gpu


def caches(kv_dtype, scales, num_blocks=6, block_size=4, kvh=3, d=32, device="cpu"):
    kc = torch.zeros(num_blocks, block_size, kvh, d, dtype=kv_dtype, device=device)
    ks = vs = None
    if scales == "token":
        ks = torch.zeros(num_blocks, block_size, kvh, device=device)
        vs = torch.zeros_like(ks)
    elif scales == "scalar":
        ks, vs = torch.tensor(0.02, device=device), torch.tensor(0.03, device=device)
    return kc, kc.clone(), ks, vs


def new_tokens(T, kvh=3, d=32, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(T)
    k = torch.randn(T, kvh, d, generator=g)
    k[0, 1] = 0.0  # an all-zero head takes the minimum scale
    return k.to(device, dtype), torch.randn(T, kvh, d, generator=g).to(device, dtype)


def clone(t):
    return None if t is None else t.clone()


@pytest.mark.parametrize("kv_dtype,scales", [(torch.float32, None), (torch.int8, "token"), (torch.int8, "scalar"),
                                             (torch.float8_e4m3fn, "token"), (torch.float8_e4m3fn, "scalar")])
def test_store_kv_matches_reference(device, kv_dtype, scales):
    kc, vc, ks, vs = caches(kv_dtype, scales, device=device)
    k, v = new_tokens(7, device=device)
    slots = torch.tensor([5, 0, -1, 23, 9, 10, 2], device=device)  # -1: padding, skipped
    ref = [kc.clone(), vc.clone(), clone(ks), clone(vs)]
    kvs.store_kv(k, v, kc, vc, slots, ks, vs)
    kvs.reference_store_kv(k, v, *ref[:2], slots, *ref[2:])
    if scales == "token":
        assert torch.equal(ks, ref[2]) and torch.equal(vs, ref[3])  # div_rn: IEEE division, as torch
    for got, want, scale in ((kc, ref[0], ref[2]), (vc, ref[1], ref[3])):
        if kv_dtype == torch.float8_e4m3fn and device.type == "cpu":
            # the interpreter's fp32 -> fp8 cast is off by up to one binade (bit-exact on GPU)
            every_block = torch.arange(got.shape[0], device=device)
            deq_got, deq_want = (gather_blocks(c, scale, every_block, torch.float32) for c in (got, want))
            assert ((deq_got - deq_want).abs() <= 0.5 * deq_want.abs() + 1e-6).all()
        else:
            assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                               want.view(torch.uint8) if want.element_size() == 1 else want)


def test_reference_store_is_the_cpu_cache_quantization():
    kc, vc, ks, vs = caches(torch.int8, "token")
    k, v = new_tokens(3)
    kvs.reference_store_kv(k, v, kc, vc, torch.tensor([0, 1, 2]), ks, vs)
    q, s = kv_quant.quantize_per_token_head(k, torch.int8)
    assert torch.equal(kc[0, :3], q) and torch.equal(ks[0, :3], s)
    assert kvs.MIN_SCALE == kv_quant._MIN_SCALE


def test_store_kv_rejects_mismatched_inputs():
    kc, vc, ks, vs = caches(torch.int8, "token")
    k, v = new_tokens(2)
    with pytest.raises(KvslimError, match="needs k_scale"):
        kvs.reference_store_kv(k, v, kc, vc, torch.tensor([0, 1]))
    with pytest.raises(KvslimError, match="slot_mapping must be int64"):
        kvs.reference_store_kv(k, v, kc, vc, torch.tensor([0, 1], dtype=torch.int32), ks, vs)
    with pytest.raises(KvslimError, match="new k/v"):
        kvs.reference_store_kv(k[:, :2], v[:, :2], kc, vc, torch.tensor([0, 1]), ks, vs)
    with pytest.raises(KvslimError, match="takes no scales"):
        kvs.reference_store_kv(k, v, kc.float(), vc.float(), torch.tensor([0, 1]), ks, vs)


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,scales", [(torch.bfloat16, None), (torch.int8, "token"), (torch.float8_e4m3fn, "token"), (torch.float8_e4m3fn, "scalar")])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_gpu_store_kv_is_bit_exact(kv_dtype, scales, x_dtype):
    kc, vc, ks, vs = caches(kv_dtype, scales, num_blocks=512, block_size=16, kvh=8, d=128, device="cuda")
    k, v = new_tokens(3000, kvh=8, d=128, device="cuda", dtype=x_dtype)
    slots = torch.randperm(512 * 16, device="cuda")[:3000]
    # The oracle is the CPU cache: on CUDA, torch divides by a Python scalar as a multiply by its
    # reciprocal, so kv_quant's per-token scale there can sit one ulp away from the CPU's.
    ref = [t.cpu().clone() if t is not None else None for t in (kc, vc, ks, vs)]
    kvs.store_kv(k, v, kc, vc, slots, ks, vs)
    kvs.reference_store_kv(k.cpu(), v.cpu(), *ref[:2], slots.cpu(), *ref[2:])
    assert torch.equal(kc.cpu().view(torch.uint8), ref[0].view(torch.uint8))
    assert torch.equal(vc.cpu().view(torch.uint8), ref[1].view(torch.uint8))
    if scales == "token":
        assert torch.equal(ks.cpu(), ref[2]) and torch.equal(vs.cpu(), ref[3])
