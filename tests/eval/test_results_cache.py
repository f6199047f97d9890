"""Results JSON: written, parsed back, keyed by checkpoint content + settings."""
import pytest

from eval.results_cache import (
    EvalResults,
    TaskScore,
    cache_key,
    checkpoint_sha256,
    load_cached,
    save,
)


def _results(value: float = 0.5) -> EvalResults:
    return EvalResults(
        checkpoint="/x",
        checkpoint_sha256="ab" * 32,
        backend="hf",
        settings={"tasks": ["arc_easy", "ppl_pydoc"], "limits": {"arc_easy": 10}},
        scores={
            "arc_easy": TaskScore("arc_easy", "acc_norm", value, 0.1, 10, True, {"acc": 0.4, "acc_norm": value}, "first 10 docs"),
            "ppl_pydoc": TaskScore("ppl_pydoc", "perplexity", 12.5, None, 512, False, {"perplexity": 12.5}, "pydoc:eval"),
        },
        seconds=1.5,
        cpu_seconds=2.5,
    )


def test_results_round_trip(tmp_path):
    r = _results()
    path = save(r, tmp_path / "r.json")
    assert load_cached(path) == r
    assert load_cached(tmp_path / "missing.json") is None


def test_cache_key_depends_on_checkpoint_and_settings():
    s = {"tasks": ["arc_easy"], "limits": {"arc_easy": 10}}
    assert cache_key("a", "hf", s) == cache_key("a", "hf", dict(s))
    assert cache_key("a", "hf", s) != cache_key("b", "hf", s)
    assert cache_key("a", "hf", s) != cache_key("a", "kvslim", s)
    assert cache_key("a", "hf", s) != cache_key("a", "hf", {**s, "limits": {"arc_easy": 11}})


def test_checkpoint_hash_follows_content(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
    h = checkpoint_sha256(tmp_path)
    assert h == checkpoint_sha256(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\1" + b"\0" * 15)
    assert checkpoint_sha256(tmp_path) != h


def test_a_low_bit_kv_format_change_is_a_new_cache_key():
    """int2 KV's stored format changed (its first block kept exact): results cached before are not reused."""
    from eval.lm_eval_runner import EvalPlan

    def read(kv_cache_dtype: str):
        return EvalPlan.make(["passkey"], None, None, 8, kv_cache_dtype=kv_cache_dtype).settings().get("kvslim_low_bit_read")

    assert read("bf16") is None and read("int4") == 2
    assert read("int2") == read("int8/int2") == 3


def test_clipped_key_ranges_are_a_new_cache_key():
    """int2 keys store clipped channel ranges: results cached before the change are not reused."""
    from eval.lm_eval_runner import EvalPlan

    def clip(kv_cache_dtype: str):
        return EvalPlan.make(["passkey"], None, None, 8, kv_cache_dtype=kv_cache_dtype).settings().get("kvslim_key_clip")

    assert clip("bf16") is None and clip("int4") is None
    assert clip("int2") == clip("int4/int2") == 0.75  # KEY_RANGE_SHRINKS' narrowest


def test_rotated_values_are_a_new_cache_key():
    """int2 values are stored in a rotated basis: results cached before the change are not reused."""
    from eval.lm_eval_runner import EvalPlan

    def basis(kv_cache_dtype: str):
        return EvalPlan.make(["passkey"], None, None, 8, kv_cache_dtype=kv_cache_dtype).settings().get("kvslim_value_basis")

    assert basis("bf16") is None and basis("int4") is None
    assert basis("int2") == basis("int4/int2") == "hadamard"


def test_retrieval_samples_reach_the_tasks_and_the_key():
    """``--retrieval-samples``: prompts per depth (4 by default: a key unchanged for the default)."""
    from eval.lm_eval_runner import EvalPlan
    from foundation.errors import KvslimError

    default = EvalPlan.make(["passkey"], None, None, 8)
    more = EvalPlan.make(["passkey"], None, None, 8, retrieval_samples=20)
    assert "retrieval_samples" not in default.settings() and more.settings()["retrieval_samples"] == 20
    assert [t.samples for t in more.retrieval_tasks()] == [20]
    assert "retrieval_samples" not in EvalPlan.make(["arc_easy"], None, None, 8, retrieval_samples=20).settings()
    with pytest.raises(KvslimError, match="--retrieval-samples"):
        EvalPlan.make(["passkey"], None, None, 8, retrieval_samples=0)


def test_a_reworded_retrieval_task_is_a_new_cache_key(monkeypatch):
    """Each retrieval task's wording is hashed into the key: rewording one re-keys it, not the others."""
    import dataclasses

    from eval import retrieval_task
    from eval.lm_eval_runner import EvalPlan

    def wordings() -> dict:
        return EvalPlan.make(["passkey", "needle_calib"], None, None, 8).settings()["retrieval_wordings"]

    before = wordings()
    assert set(before) == {"passkey", "needle_calib"} and "retrieval_wordings" not in EvalPlan.make(
        ["arc_easy"], None, None, 8).settings()
    reworded = dataclasses.replace(retrieval_task.WORDINGS["needle_calib"], fact="The code is {key}. ")
    monkeypatch.setitem(retrieval_task.WORDINGS, "needle_calib", reworded)
    after = wordings()
    assert after["needle_calib"] != before["needle_calib"] and after["passkey"] == before["passkey"]


def test_auto_keys_the_storage_rules_of_the_dtype_a_plan_chooses(tmp_path):
    """Under ``--kv-cache-dtype auto`` a checkpoint's plan.json picks the packed dtype: its storage
    rules are keyed as if it had been named, on the kvslim backend only."""
    import json

    from eval.lm_eval_runner import EvalPlan, auto_kv_dtype_of

    (tmp_path / "plan.json").write_text(json.dumps({"kv_cache_dtype": "int8/int2"}))
    plan = EvalPlan.make(["passkey"], None, None, 8)
    keyed = plan.settings(auto_kv_dtype_of(tmp_path, "kvslim"))
    named = EvalPlan.make(["passkey"], None, None, 8, kv_cache_dtype="int8/int2").settings()
    rules = ("kvslim_low_bit_read", "kvslim_key_clip", "kvslim_key_basis", "kvslim_value_basis")
    assert [keyed.get(r) for r in rules] == [named.get(r) for r in rules] != [None] * 4
    assert "kvslim_kv_cache_dtype" not in keyed  # the checkpoint's hash already names what auto chose
    assert auto_kv_dtype_of(tmp_path, "hf") is None and auto_kv_dtype_of(tmp_path / "none", "kvslim") is None
    assert plan.settings(None) == plan.settings()


def test_rotated_keys_are_a_new_cache_key():
    """4-bit keys are stored in a rotated basis: results cached before the change are not reused;
    int2's pre-RoPE key entry is unchanged."""
    from eval.lm_eval_runner import EvalPlan

    def basis(kv_cache_dtype: str):
        plan = EvalPlan.make(["passkey"], None, None, 8, kv_cache_dtype=kv_cache_dtype)
        return plan.settings().get("kvslim_key_basis")

    assert basis("bf16") is None and basis("int2") == basis("k3v2") == "pre-rope"
    assert basis("int4") == basis("k4v2") == basis("int8/int4") == "hadamard"
    assert basis("int4/int2") == "pre-rope+hadamard"
