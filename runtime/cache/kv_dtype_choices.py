"""The KV-cache dtypes a user names on the command line (torch-free: argparse reads it)."""
from __future__ import annotations

import argparse

from foundation.errors import KvslimError
from foundation.kv_dtype_mix import KV_VARIANTS, SEPARATOR, KvDtypeMix, split_variants

# command-line name -> the cache's KV dtype name (None: the checkpoint's kv_cache_scheme, else its
# plan.json's, else the activation dtype)
KV_CACHE_DTYPES: dict[str, str | None] = {
    "auto": None, "fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "fp8_e4m3", "int8": "int8",
    "int4": "int4", "k4v2": "k4v2", "k3v2": "k3v2", "int2": "int2",
}
KV_CACHE_DTYPE_HELP = ("KV cache dtype: auto (the checkpoint's kv_cache_scheme, else its KV plan's, else the "
                       "activation dtype), fp32/bf16/fp16, fp8 or int8 (per token and head), int4, k4v2 or "
                       "k3v2 (4- or 3-bit keys, 2-bit values) or int2 (keys per channel over 64-token blocks, 2- and "
                       "3-bit keys before RoPE, 4-bit keys rotated, values per token; the block being filled "
                       "stays exact); "
                       f"FULL{SEPARATOR}WINDOWED, e.g. int8{SEPARATOR}int2, stores full-attention "
                       "KV in the first and sliding layers' and streaming heads' KV in the second; packed KV may "
                       f"name variants after a colon, joined by +: {', '.join(KV_VARIANTS)} (e.g. "
                       "int4:exact-first-block)")


def cache_kv_dtype(name: str, names: dict[str, str | None] = KV_CACHE_DTYPES) -> str | None:
    """A command-line name -> the cache's (``fp8/int2`` -> ``fp8_e4m3/int2``); None for auto.
    ``names``: spelling -> the cache's name (another caller's aliases)."""
    if name == "auto":
        return None
    known = tuple(n for n in names if n != "auto")
    try:
        KvDtypeMix.parse(split_variants(name)[0], known)
    except KvslimError:
        raise KvslimError(f"unknown KV cache dtype {name!r}; choose one of {', '.join(names)}, "
                          f"or FULL{SEPARATOR}WINDOWED (e.g. int8{SEPARATOR}int2)") from None
    mix = KvDtypeMix.parse(name, known)  # the variants' own one-line errors
    return KvDtypeMix(names[mix.full], names[mix.windowed], mix.variants).name


def is_kv_cache_dtype(name: str) -> bool:
    """``auto``, one name of ``KV_CACHE_DTYPES`` or ``FULL/WINDOWED`` of two."""
    try:
        cache_kv_dtype(name)
    except KvslimError:
        return False
    return True


def kv_cache_dtype_arg(name: str) -> str:
    """argparse ``type=``: the name as given, refused in one line when unknown."""
    try:
        cache_kv_dtype(name)
    except KvslimError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name
