"""One residual slot table per int4/int2 cache group, updated once per step for all its layers."""
from unittest import mock

import pytest
import torch

from foundation.errors import KvslimError
from runtime.attention.paged import PagedBatch
from runtime.cache.residual_slots import ResidualSlots
from runtime.cache.write_plan import WritePlan
from runtime.engine.engine import Engine, EngineConfig
from runtime.engine.sampling import SamplingParams
from runtime.model.loader import load_model

BS = 4


def test_apply_records_the_slots_filled_blocks_held_then_reuses_them():
    slots = ResidualSlots(num_blocks=8, num_slots=2, device="cpu")
    first = slots.apply(WritePlan.of(torch.tensor([8, 9, 10]), BS))  # block 2 opens
    assert first.full_slots.tolist() == [] and slots.slot_host[2] == 0 and not first.refills
    # block 2 fills (it held slot 0), block 5 opens in the same step and takes that slot back
    second = slots.apply(WritePlan.of(torch.tensor([11, 20]), BS))
    assert second.full_blocks == (2,) and second.full_slots.tolist() == [0] and second.refills
    assert slots.slot_host[2] == -1 and slots.slot_host[5] == 0 and slots.slot_of[5] == 0
    slots.apply(WritePlan.of(torch.tensor([24]), BS))  # block 6: the second slot
    with pytest.raises(KvslimError, match="residual blocks are in use"):
        slots.apply(WritePlan.of(torch.tensor([28]), BS))
    slots.release((5, 6))
    assert slots.open_blocks == 0 and sorted(slots._free) == [0, 1]


def test_a_groups_layers_share_one_table(tiny_llama):
    model = load_model(tiny_llama, "float32")
    engine = Engine(model, EngineConfig(kv_dtype="int4", block_size=8, max_num_batched_tokens=64, max_model_len=96,
                                        kv_cache_bytes=4 << 20))
    (group,) = engine.cache.packed
    assert len(group) > 1 and all(layer.slots is engine.cache.residual_slots[0] for layer in group)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for p in ([5, 6, 7], list(range(10, 31))):
        engine.add_request(p, params)
    applied, planned = [], []
    original_apply, original_plan = ResidualSlots.apply, PagedBatch.write_plan

    def counted_apply(self, plan):
        applied.append(plan)
        return original_apply(self, plan)

    def counted_plan(self, g, exact_first_block=False):
        planned.append(g)
        return original_plan(self, g, exact_first_block)

    with mock.patch.object(ResidualSlots, "apply", counted_apply), mock.patch.object(PagedBatch, "write_plan", counted_plan):
        steps = 0
        while engine.has_unfinished:
            engine.step()
            steps += 1
    assert len(applied) == len(planned) == steps  # once per step for the one group, not once per layer
    assert engine.cache.residual_slots[0].open_blocks == 0  # every sequence freed its open block
