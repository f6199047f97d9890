"""Evaluate a checkpoint once per (checkpoint bytes, backend, settings): results are cached."""
from __future__ import annotations

import sys
from pathlib import Path

from eval import results_cache
from eval.lm_eval_runner import EvalPlan, auto_kv_dtype_of, run_eval
from eval.results_cache import EvalResults


def evaluate_cached(ckpt: str | Path, plan: EvalPlan, backend: str, use_cache: bool = True
                    ) -> tuple[EvalResults, Path]:
    """``(results, cache file)``: the cached results of this exact checkpoint and plan when
    ``use_cache`` finds them (named on stderr), else a fresh run, then cached."""
    sha = results_cache.checkpoint_sha256(ckpt)
    path = results_cache.cache_path(sha, backend, plan.settings(auto_kv_dtype_of(ckpt, backend)))
    cached = results_cache.load_cached(path) if use_cache else None
    if cached is not None:
        print(f"cached: {path}", file=sys.stderr)
        return cached, path
    results = run_eval(ckpt, sha, plan, backend)
    results_cache.save(results, path)
    return results, path
