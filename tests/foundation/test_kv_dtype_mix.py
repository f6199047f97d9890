import json

import pytest

from foundation.errors import CheckpointError, KvslimError
from foundation.kv_dtype_mix import KvDtypeMix, split_variants
from foundation.kv_plan_file import PLAN_KV_DTYPES, planned_kv_dtype

KNOWN = ("bf16", "int8", "int4", "int2")


def test_one_name_is_every_kind():
    mix = KvDtypeMix.parse("int4", KNOWN)
    assert (mix.of("full"), mix.of("sliding"), mix.dtypes, mix.name) == ("int4", "int4", ("int4",), "int4")


def test_full_and_windowed():
    mix = KvDtypeMix.parse("int8/int2", KNOWN)
    assert (mix.of("full"), mix.of("sliding"), mix.dtypes, mix.name) == ("int8", "int2", ("int8", "int2"), "int8/int2")
    assert KvDtypeMix.parse("int4/int4", KNOWN).name == "int4"


@pytest.mark.parametrize("name", ["fp64", "int8/fp64", "int8/int4/int2", "/int4", None])
def test_unknown_names_are_refused(name):
    with pytest.raises(KvslimError, match="unknown KV dtype"):
        KvDtypeMix.parse(name, KNOWN)


def test_plan_file_carries_a_mix(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps({"kv_cache_dtype": "int8/int2"}))
    assert planned_kv_dtype(tmp_path) == "int8/int2"
    (tmp_path / "plan.json").write_text(json.dumps({"kv_cache_dtype": "int8/int3"}))
    with pytest.raises(CheckpointError, match="FULL/WINDOWED"):
        planned_kv_dtype(tmp_path)
    assert "int2" in PLAN_KV_DTYPES


def test_variants_follow_a_colon_in_a_fixed_order():
    mix = KvDtypeMix.parse("int8/int2:values-unrotated+keys-unclipped", KNOWN)
    assert (mix.full, mix.windowed, mix.variants) == ("int8", "int2", ("keys-unclipped", "values-unrotated"))
    assert mix.name == "int8/int2:keys-unclipped+values-unrotated" and mix.of("sliding") == "int2"
    assert KvDtypeMix.parse(mix.name, KNOWN) == mix


@pytest.mark.parametrize("name, message", [
    ("int4:sideways", "unknown KV variant 'sideways'"),
    ("int4:", "unknown KV variant ''"),
    ("int4:exact-first-block+quantized-first-block", "contradict"),
    ("int5:exact-first-block", "unknown KV dtype"),
])
def test_bad_variants_are_one_line(name, message):
    with pytest.raises(KvslimError, match=message):
        KvDtypeMix.parse(name, KNOWN)


def test_plan_file_carries_a_variant(tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps({"kv_cache_dtype": "int4:exact-first-block"}))
    assert planned_kv_dtype(tmp_path) == "int4:exact-first-block"

    (tmp_path / "plan.json").write_text(json.dumps({"kv_cache_dtype": "int4:sideways"}))
    with pytest.raises(CheckpointError, match="plan.json: unknown KV variant 'sideways'"):
        planned_kv_dtype(tmp_path)


def test_split_variants():
    assert split_variants("int8/int2:keys-unclipped+values-unrotated") == ("int8/int2", ("keys-unclipped", "values-unrotated"))
    assert split_variants("int4") == ("int4", ())
