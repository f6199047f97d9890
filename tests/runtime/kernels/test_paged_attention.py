import pytest
import torch

from foundation.errors import KvslimError
from runtime.attention.backend import reference_attention
from runtime.kernels import paged_attention as pa
from runtime.kernels.split_merge import merge_splits_into
from tests.runtime.conftest import requires_gpu
from tests.runtime.kernels.paged_setup import make_paged_batch

# decode (q_len 1), prefill (q_len = ctx) and extend over a cached prefix, in one batch
CTX, QLEN = [9, 1, 13], [9, 1, 3]


def test_reference_matches_dense_attention_on_unpaged_tensors():
    b = make_paged_batch(CTX, QLEN, 4, 2, 16, torch.float32, None)
    out = pa.reference_paged_attention(*b.args(), scale=0.25)
    # sequence 2: rebuild its K/V from the block table by hand
    bt, ctx = b.block_tables[2].long(), 13
    pos = torch.arange(ctx)
    k = b.k_cache[bt[pos // 4], pos % 4]
    v = b.v_cache[bt[pos // 4], pos % 4]
    q = b.q[10:13]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=(pos.view(1, -1) <= torch.arange(10, 13).view(-1, 1)), scale=0.25).transpose(0, 1)
    torch.testing.assert_close(out[10:13], expected, rtol=1e-5, atol=1e-5)


CASES = [  # (heads, kv heads, head dim, kv dtype, scales, window, softcap, splits)
    (6, 2, 32, torch.float32, None, None, None, None),     # GQA 3
    (4, 1, 16, torch.float32, None, 5, None, None),        # MQA, sliding window
    (4, 4, 16, torch.float32, None, None, 30.0, 3),        # MHA, softcap, split context
    (6, 2, 32, torch.int8, "token", 4, None, 2),           # INT8 KV per token, window + split
    (6, 2, 32, torch.float8_e4m3fn, "token", None, None, None),
    (4, 2, 64, torch.int8, "scalar", None, None, None),    # per-layer scalar scales
]


@pytest.mark.parametrize("H,KVH,D,kv_dtype,scales,window,softcap,splits", CASES)
def test_paged_attention_matches_reference(device, H, KVH, D, kv_dtype, scales, window, softcap, splits):
    b = make_paged_batch(CTX, QLEN, H, KVH, D, kv_dtype, scales, device=device)
    kw = dict(scale=D ** -0.5, window=window, softcap=softcap, k_scale=b.k_scale, v_scale=b.v_scale)
    out = pa.paged_attention(*b.args(), num_splits=splits, **kw)
    ref = pa.reference_paged_attention(*b.args(), **kw)
    tol = 1e-2 if device.type == "cuda" else 1e-5  # tf32 dots on GPU
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("kv_dtype,scales,window,splits,lens", [
    (torch.int8, "token", None, None, (CTX, QLEN)),
    (torch.float8_e4m3fn, "token", 4, 2, (CTX, QLEN)),
    (torch.int8, "scalar", None, 3, (CTX, QLEN)),
    # key tiles wholly before the step's own rows (a decode at 37, 3 new rows at 70) and tiles holding some
    (torch.int8, "token", None, None, ([40, 37, 70], [40, 1, 3])),
    (torch.float8_e4m3fn, "token", None, 2, ([40, 37, 70], [40, 1, 3])),
])
def test_the_steps_own_rows_are_read_exact_from_a_quantized_cache(device, kv_dtype, scales, window, splits, lens):
    """Given the step's new rows, the kernel attends them exact in place of their quantized copies
    (the prompt in full precision), every earlier row as stored; the reference does the same."""
    ctx, qlen = lens
    b = make_paged_batch(ctx, qlen, 6, 2, 32, kv_dtype, scales, device=device)
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(sum(qlen), 2, 32, generator=g).to(device) for _ in range(2))
    kw = dict(scale=32 ** -0.5, window=window, k_scale=b.k_scale, v_scale=b.v_scale)
    out = pa.paged_attention(*b.args(), num_splits=splits, k=k, v=v, **kw)
    ref = pa.reference_paged_attention(*b.args(), k=k, v=v, **kw)
    tol = 1e-2 if device.type == "cuda" else 1e-5
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert not torch.allclose(ref, pa.reference_paged_attention(*b.args(), **kw), atol=1e-3)  # the rows matter
    with pytest.raises(KvslimError, match="from a quantized cache only"):
        exact = make_paged_batch(ctx, qlen, 6, 2, 32, torch.float32, None, device=device)
        pa.paged_attention(*exact.args(), scale=1.0, k=k, v=v)


@pytest.mark.parametrize("kv_dtype,scales,window,sinks,softcap,splits,lens", [
    (torch.int8, "token", None, 0, None, None, (CTX, QLEN)),
    (torch.float8_e4m3fn, "token", 4, 0, 30.0, 2, (CTX, QLEN)),
    (torch.int8, "scalar", None, 0, None, 3, ([40, 37, 70], [40, 1, 3])),
    (torch.float8_e4m3fn, "token", 6, 2, None, 2, ([40, 37, 70], [40, 1, 3])),
])
def test_each_token_can_read_only_its_own_row_exact(device, kv_dtype, scales, window, sinks, softcap, splits, lens):
    """``own_row_only``: every token reads its own new row exact and every other row, the step's
    too, as stored (what a decode step of that token reads). The reference against a row-by-row
    definition, the kernel against the reference."""
    ctx, qlen = lens
    b = make_paged_batch(ctx, qlen, 6, 2, 32, kv_dtype, scales, device=device)
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(sum(qlen), 2, 32, generator=g).to(device) for _ in range(2))
    kw = dict(scale=32 ** -0.5, window=window, softcap=softcap, sinks=sinks, k_scale=b.k_scale, v_scale=b.v_scale)
    ref = pa.reference_paged_attention(*b.args(), k=k, v=v, own_row_only=True, **kw)
    starts = [0]
    for n in qlen:
        starts.append(starts[-1] + n)
    for s, c in enumerate(ctx):
        kk = pa.gather_sequence_kv(b.k_cache, b.k_scale, b.block_tables[s], c)
        vv = pa.gather_sequence_kv(b.v_cache, b.v_scale, b.block_tables[s], c)
        for row in range(starts[s], starts[s + 1]):
            pos = c - (starts[s + 1] - row)
            k1, v1 = kk.clone(), vv.clone()
            k1[pos], v1[pos] = k[row].float(), v[row].float()
            want = reference_attention(b.q[row:row + 1].float(), k1, v1, torch.tensor([pos], device=device),
                                       torch.arange(c, device=device), 32 ** -0.5, window, softcap, sinks)
            torch.testing.assert_close(ref[row:row + 1], want.to(ref.dtype), rtol=1e-5, atol=1e-5)
    out = pa.paged_attention(*b.args(), num_splits=splits, k=k, v=v, own_row_only=True, **kw)
    tol = 1e-2 if device.type == "cuda" else 1e-5
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    every_new_row = pa.reference_paged_attention(*b.args(), k=k, v=v, **kw)
    assert not torch.allclose(ref, every_new_row, atol=1e-3)  # prefills differ; decodes agree
    decode = torch.tensor([starts[i] for i, n in enumerate(qlen) if n == 1])
    torch.testing.assert_close(ref[decode], every_new_row[decode], rtol=1e-5, atol=1e-5)


# Long enough that later query tiles and decodes start their window past the sinks.
SINK_CTX, SINK_QLEN = [40, 37, 70], [40, 1, 3]
SINK_CASES = [  # (heads, kv heads, head dim, kv dtype, window, sinks, splits)
    (4, 1, 16, torch.float32, 3, 2, None),   # sinks inside the first key tile
    (6, 2, 32, torch.int8, 4, 5, 2),         # sinks over two blocks, split context
    (4, 4, 16, torch.float32, 6, 40, 3),     # sinks past the window's start
]


@pytest.mark.parametrize("H,KVH,D,kv_dtype,window,sinks,splits", SINK_CASES)
def test_sinks_match_reference(device, H, KVH, D, kv_dtype, window, sinks, splits):
    b = make_paged_batch(SINK_CTX, SINK_QLEN, H, KVH, D, kv_dtype, "token" if kv_dtype == torch.int8 else None,
                         device=device)
    kw = dict(scale=D ** -0.5, window=window, k_scale=b.k_scale, v_scale=b.v_scale)
    out = pa.paged_attention(*b.args(), num_splits=splits, sinks=sinks, **kw)
    ref = pa.reference_paged_attention(*b.args(), sinks=sinks, **kw)
    tol = 1e-2 if device.type == "cuda" else 1e-5  # tf32 dots on GPU
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert not torch.allclose(ref, pa.reference_paged_attention(*b.args(), **kw), atol=1e-3)  # the sinks matter


def test_decode_split_merges_to_the_unsplit_result(device):
    b = make_paged_batch([37, 20], [1, 1], 4, 2, 16, torch.float32, None, device=device)
    one = pa.paged_attention(*b.args(), scale=0.25, num_splits=1)
    many = pa.paged_attention(*b.args(), scale=0.25, num_splits=4)
    tol = 1e-2 if device.type == "cuda" else 1e-5  # tf32 dots on GPU
    torch.testing.assert_close(one, many, rtol=tol, atol=tol)


@pytest.mark.parametrize("splits", [1, 3])
def test_a_row_with_context_0_is_zeros_not_nan(device, splits):
    """A CUDA graph's padded rows: no key to read. The kernel and the split merge give zeros, and
    the real rows beside them their own results (launched for a longer context than any holds)."""
    b = make_paged_batch([37, 20], [1, 1], 4, 2, 16, torch.float32, None, device=device)
    alone = pa.paged_attention(*b.args(), scale=0.25, num_splits=splits)
    padded_ctx = torch.cat([b.context_lens, torch.zeros(2, dtype=torch.int32, device=device)])
    qsl = torch.arange(5, dtype=torch.int32, device=device)
    tables = torch.cat([b.block_tables, torch.zeros_like(b.block_tables)])
    q = torch.cat([b.q, torch.randn_like(b.q)])
    out = pa.paged_attention(q, b.k_cache, b.v_cache, tables, padded_ctx, qsl, scale=0.25, num_splits=splits,
                             max_query_len=1, max_context_len=96)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    tol = 1e-2 if device.type == "cuda" else 1e-5
    torch.testing.assert_close(out[:2], alone, rtol=tol, atol=tol)


def test_split_merge_of_rows_no_split_saw_is_zeros(device):
    lse = torch.tensor([[[float("-inf")], [1.0]], [[float("-inf")], [float("-inf")]]])  # [splits 2, T 2, H 1]
    partial = torch.ones(2, 2, 1, 4)
    merged = pa.merge_splits(lse, partial)
    assert torch.equal(merged[0], torch.zeros(1, 4)) and torch.equal(merged[1], torch.ones(1, 4))
    out = merge_splits_into(lse.to(device), partial.to(device), torch.full((2, 1, 4), float("nan"), device=device))
    assert torch.equal(out.cpu(), merged)


@pytest.mark.parametrize("splits,D,dtype", [(2, 16, torch.float32), (5, 24, torch.float32),
                                            pytest.param(8, 64, torch.bfloat16, marks=requires_gpu)])
def test_split_merge_kernel_matches_its_torch_definition(device, splits, D, dtype):
    """One launch for the merge (vLLM's v2 reduce): splits not a power of two, head_dim padded,
    the output in q's dtype (bf16 on a GPU: the interpreter casts fp32 to bf16 wrongly), splits
    that saw no key (-inf) among them."""
    g = torch.Generator().manual_seed(splits)
    lse = torch.randn(splits, 7, 3, generator=g) * 4
    lse[0, 2] = float("-inf")
    partial = torch.randn(splits, 7, 3, D, generator=g)
    out = merge_splits_into(lse.to(device), partial.to(device), torch.empty(7, 3, D, dtype=dtype, device=device))
    torch.testing.assert_close(out.cpu(), pa.merge_splits(lse, partial).to(dtype), rtol=1e-5, atol=1e-5)


def test_shared_kv_layer_reads_the_owner_cache():
    """A layer with kv_source != itself passes the owner's tensors: nothing else changes."""
    b = make_paged_batch(CTX, QLEN, 4, 2, 16, torch.float32, None)
    owner = pa.reference_paged_attention(*b.args(), scale=0.25)
    seq = 2
    k = pa.gather_sequence_kv(b.k_cache, None, b.block_tables[seq], 13)
    v = pa.gather_sequence_kv(b.v_cache, None, b.block_tables[seq], 13)
    direct = reference_attention(b.q[10:13], k, v, torch.arange(10, 13), torch.arange(13), 0.25)
    torch.testing.assert_close(owner[10:13], direct)


def test_bad_inputs_raise_one_line_errors():
    b = make_paged_batch([5], [1], 4, 2, 16, torch.int8, "token")
    with pytest.raises(KvslimError, match="needs k_scale"):
        pa.reference_paged_attention(*b.args(), scale=1.0)
    with pytest.raises(KvslimError, match="not a multiple"):
        pa.reference_paged_attention(b.q[:, :3], *b.args()[1:], scale=1.0, k_scale=b.k_scale, v_scale=b.v_scale)
    with pytest.raises(KvslimError, match="context_lens must be int32"):
        pa.reference_paged_attention(*b.args()[:4], b.context_lens.long(), b.query_start_loc, scale=1.0,
                                     k_scale=b.k_scale, v_scale=b.v_scale)


# ------------------------------------------------------------------ GPU: real sizes, bf16 q
@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,scales", [(torch.bfloat16, None), (torch.float8_e4m3fn, "token"), (torch.int8, "token"), (torch.float8_e4m3fn, "scalar")])
@pytest.mark.parametrize("H,KVH,D,window", [(9, 3, 64, None), (32, 8, 128, None), (8, 1, 256, 512)])
def test_gpu_paged_attention_real_sizes(kv_dtype, scales, H, KVH, D, window):
    ctx = [1500, 7, 900, 2048, 333]
    qlen = [1, 7, 1, 130, 1]
    b = make_paged_batch(ctx, qlen, H, KVH, D, kv_dtype, scales, block_size=16, q_dtype=torch.bfloat16, device="cuda")
    kw = dict(scale=D ** -0.5, window=window, k_scale=b.k_scale, v_scale=b.v_scale)
    out = pa.paged_attention(*b.args(), **kw).float()
    ref = pa.reference_paged_attention(*b.args(), **kw).float()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    decode = make_paged_batch([4000] * 4, [1] * 4, H, KVH, D, kv_dtype, scales, block_size=16, q_dtype=torch.bfloat16, device="cuda")
    kw.update(k_scale=decode.k_scale, v_scale=decode.v_scale)
    out = pa.paged_attention(*decode.args(), **kw).float()  # exercises the split-context path
    ref = pa.reference_paged_attention(*decode.args(), **kw).float()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_the_steps_own_rows_are_checked():
    """k and v come together, shaped ``[T, KVH, D]`` in q's dtype, and only over a quantized cache."""
    q, cache, scale = torch.zeros(5, 4, 8), torch.zeros(3, 4, 2, 8, dtype=torch.int8), torch.ones(3, 4, 2)
    rows = torch.zeros(5, 2, 8)
    pa.check_new_rows(q, rows, rows, cache, scale)
    pa.check_new_rows(q, None, None, cache, None)
    for k, v, s, match in [(rows, None, scale, "together"), (rows, rows, None, "quantized cache only"),
                           (torch.zeros(4, 2, 8), rows, scale, "must be"), (rows.double(), rows, scale, "must be")]:
        with pytest.raises(KvslimError, match=match):
            pa.check_new_rows(q, k, v, cache, s)
