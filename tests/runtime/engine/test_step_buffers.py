"""StepBuffers: one arena for a step's inputs, one copy to the device."""
import pytest
import torch

from foundation.attention_layout import AttentionLayout
from runtime.cache.kv_cache import KVCache, KVCacheSpec
from runtime.engine.cuda_graphs import DecodeInputs, DecodeRow, DecodeShape
from runtime.engine.step_buffers import ALIGN, StepBuffers


def test_buffers_are_aligned_views_of_one_arena_with_their_fill():
    b = StepBuffers(torch.device("cpu"))
    ids, table, flags = b.add((3,), torch.long, 7), b.add((2, 5), torch.int32, -1), b.add((3,), torch.bool, True)
    assert b.nbytes == 32 + 48 + ALIGN  # 24, 40 and 3 bytes, each rounded up to a multiple of 16
    assert b.host(ids).tolist() == [7, 7, 7] and b.host(table).shape == (2, 5) and b.host(flags).all()
    assert b.host(table).dtype == torch.int32 and (b.host(table) == -1).all()
    bases = {b.host(h).untyped_storage().data_ptr() for h in (ids, table, flags)}
    assert len(bases) == 1  # one storage
    b.host(table)[1, 2] = 9
    b.copy_to_device()
    assert b.device(table)[1, 2] == 9 and b.device(ids).tolist() == [7, 7, 7]


def test_a_buffer_reserved_after_the_arena_is_made_is_refused():
    b = StepBuffers(torch.device("cpu"))
    b.add((1,), torch.long, 0)
    b.host(0)
    with pytest.raises(RuntimeError, match="reserved before"):
        b.add((1,), torch.long, 0)


class NonBlockingCopies(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and kwargs.get("non_blocking", len(args) > 2 and args[2]):
            self.count += 1
        return func(*args, **kwargs)


def test_a_decode_step_reaches_the_device_in_one_copy_packed_write_plans_included():
    config = dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, hidden_size=32, head_dim=16)
    spec = KVCacheSpec.from_layout(AttentionLayout.from_config(config), "int4", 4)
    cache = KVCache(spec, (16,), device="cpu", residual_blocks=8)
    inputs = DecodeInputs(DecodeShape(max_rows=4, block_size=4, max_model_len=32, num_groups=1), torch.device("cpu"),
                          cache)
    with NonBlockingCopies() as copies:
        inputs.fill([DecodeRow(5, 3, ([2],)), DecodeRow(6, 0, ([4],))], bucket=2)
    assert copies.count == 1
    plan = inputs.batch(2).write_plans[0]
    assert plan.full.tolist() == [2, -1]  # position 3 fills block 2; position 0 opens block 4
