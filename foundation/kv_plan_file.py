"""``plan.json``: the KV plan a checkpoint carries (written by ``compress convert --kv-budget``).

The planner (``eval.kv_plan``) writes it; the runtime reads its KV dtype (one name, or a mix such as
``int8/int2``: ``foundation.kv_dtype_mix``) as the default for
``--kv-cache-dtype auto``, and ``compress inspect`` prints its bytes. One reader, here.
"""
from __future__ import annotations

import json
from pathlib import Path

from foundation.errors import CheckpointError, KvslimError
from foundation.kv_dtype_mix import SEPARATOR, KvDtypeMix, split_variants

PLAN_FILE = "plan.json"
# what plan.json may carry
PLAN_KV_DTYPES = ("bf16", "fp16", "fp32", "fp8_e4m3", "int8", "int4", "k4v2", "k3v2", "int2")
PLANNER_KV_DTYPES = ("bf16", "int8", "int4", "int2")  # what the planner chooses from by default
PLANNER_KV_CHOICES = (*PLANNER_KV_DTYPES, "k4v2", "k3v2")  # what it may be asked to choose from (--kv-dtypes)


def read_plan(checkpoint_dir: str | Path) -> dict | None:
    """The checkpoint's plan, or None when it carries none; a one-line error when it is unreadable."""
    path = Path(checkpoint_dir) / PLAN_FILE
    if not path.is_file():
        return None
    try:
        plan = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable KV plan ({e})") from None
    dtype = plan.get("kv_cache_dtype") if isinstance(plan, dict) else None
    try:
        KvDtypeMix.parse(split_variants(dtype)[0] if isinstance(dtype, str) else dtype, PLAN_KV_DTYPES)
    except KvslimError:
        raise CheckpointError(f"{path}: a KV plan needs kv_cache_dtype, one of {', '.join(PLAN_KV_DTYPES)} "
                              f"or FULL{SEPARATOR}WINDOWED (e.g. int8{SEPARATOR}int2), found {dtype!r}") from None
    try:
        KvDtypeMix.parse(dtype, PLAN_KV_DTYPES)
    except KvslimError as e:  # its variants
        raise CheckpointError(f"{path}: {e}") from None
    return plan


def planned_kv_dtype(checkpoint_dir: str | Path) -> str | None:
    """The KV cache dtype the checkpoint's plan chose, or None without a plan."""
    plan = read_plan(checkpoint_dir)
    return None if plan is None else plan["kv_cache_dtype"]
