"""The one store and gather of paged K/V rows: what is stored at a slot is read back there."""
import pytest
import torch

from runtime.cache.kv_quant import QMAX
from runtime.cache.paged_rows import gather_blocks, store_rows

BLOCKS, BS, KVH, D = 4, 4, 2, 8


@pytest.mark.parametrize("dtype,scale_kind", [(torch.float32, None), (torch.bfloat16, None), (torch.int8, "token"),
                                              (torch.int8, "static"), (torch.float8_e4m3fn, "token")])
def test_store_then_gather_round_trips(dtype, scale_kind):
    g = torch.Generator().manual_seed(0)
    cache = torch.zeros(BLOCKS, BS, KVH, D, dtype=dtype)
    scale = {None: None, "token": torch.zeros(BLOCKS, BS, KVH), "static": torch.tensor(0.05)}[scale_kind]
    x = torch.randn(5, KVH, D, generator=g)
    slots = torch.tensor([13, 0, 6, 7, 2])
    store_rows(cache, scale, x, slots)
    rows = gather_blocks(cache, scale, torch.tensor([[3, 0, 1]]), torch.float32)  # [1, 12, KVH, D]
    assert rows.shape == (1, 3 * BS, KVH, D)
    logical = {13: 1, 0: 4, 6: 10, 7: 11, 2: 6}  # slot -> row in the gathered blocks 3, 0, 1
    step = {torch.float32: 0.0, torch.bfloat16: 2**-8, torch.int8: 1 / QMAX[torch.int8], torch.float8_e4m3fn: 2**-3}[dtype]
    for i, slot in enumerate(slots.tolist()):
        amax = x[i].abs().amax(-1, keepdim=True) if scale_kind != "static" else torch.tensor(0.05 * 127)
        torch.testing.assert_close(rows[0, logical[slot]], x[i].clamp(-amax, amax), atol=float(amax.max()) * step, rtol=0)
