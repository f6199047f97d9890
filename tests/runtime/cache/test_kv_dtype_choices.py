import argparse

import pytest

from foundation.errors import KvslimError
from runtime.cache.kv_dtype_choices import cache_kv_dtype, is_kv_cache_dtype, kv_cache_dtype_arg


def test_command_line_names_map_to_the_caches_one_part_at_a_time():
    assert cache_kv_dtype("auto") is None
    assert cache_kv_dtype("fp8") == "fp8_e4m3"
    assert cache_kv_dtype("fp8/int2") == "fp8_e4m3/int2"
    assert cache_kv_dtype("k4v2") == "k4v2" and cache_kv_dtype("k4v2/int2") == "k4v2/int2"  # 4-bit keys, 2-bit values
    assert cache_kv_dtype("k3v2") == "k3v2"
    assert cache_kv_dtype("int4/int4") == "int4"  # a mix of one dtype is that dtype
    assert cache_kv_dtype("bfloat16/int4", {"bfloat16": "bf16", "int4": "int4"}) == "bf16/int4"  # another's aliases


@pytest.mark.parametrize("name", ["int3", "auto/int4", "int8/int4/int2", "int8/", "/int2"])
def test_unknown_names_are_one_line(name):
    assert not is_kv_cache_dtype(name)
    with pytest.raises(KvslimError, match="unknown KV cache dtype"):
        cache_kv_dtype(name)
    with pytest.raises(argparse.ArgumentTypeError, match="unknown KV cache dtype"):
        kv_cache_dtype_arg(name)
