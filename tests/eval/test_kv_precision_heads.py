"""KV bits per head on a tiny random Llama with the default model's tokenizer: the split is exact
attention (logits unchanged), the retrieval heads are the ranking's top, the
runtime serves the mix by default, the bytes are the allocator's, and bad requests are one line."""
import json

import pytest
import torch

from eval.kv_precision_heads import choose_precision_heads, write_precision_heads
from foundation.errors import KvslimError
from foundation.kv_plan_file import planned_kv_dtype, read_plan

CTX = 64


@pytest.fixture(scope="module")
def split(tiny_with_tokenizer, tmp_path_factory):
    heads = choose_precision_heads(tiny_with_tokenizer, "int4/int2", 0.25, CTX, samples=1, progress=lambda _: None)
    return heads, write_precision_heads(tiny_with_tokenizer, heads, tmp_path_factory.mktemp("heads") / "split")


def test_the_top_ranked_share_keeps_the_high_dtype(tiny_with_tokenizer, split, monkeypatch):
    heads, _ = split
    kept = [(layer, h) for layer, hs in enumerate(heads.kept) for h in hs]
    assert len(kept) == 2 and sum(map(len, heads.lowered)) == 6  # 0.25 of 4 layers x 2 KV heads
    import eval.kv_plan_measurements as measurements

    order = [(3, 1), (0, 0), (1, 0), (2, 1), (0, 1), (1, 1), (2, 0), (3, 0)]
    monkeypatch.setattr(measurements, "retrieval_rank", lambda *a: order)
    again = choose_precision_heads(tiny_with_tokenizer, "int4/int2", 0.25, CTX, samples=1, progress=lambda _: None)
    assert again.kept == ((0,), (), (), (1,)) and again.lowered == ((1,), (0, 1), (0, 1), (0,))


def test_the_heads_are_ranked_on_the_calibration_tasks_asked(tiny_with_tokenizer, monkeypatch):
    import eval.kv_plan_measurements as measurements

    seen = []
    monkeypatch.setattr(measurements, "retrieval_rank", lambda _path, _tok, prompts: seen.extend(prompts) or
                        [(layer, h) for layer in range(4) for h in range(2)])
    tasks = ("needle_calib", "needle_code_calib")
    heads = choose_precision_heads(tiny_with_tokenizer, "int4/int2", 0.25, CTX, samples=2, tasks=tasks,
                                   progress=lambda _: None)
    assert len(seen) == 2 * 5 * 2 and "needle_code_calib" in heads.prompts
    assert sum("secret number for this week" in p.text for p in seen) == 10


def test_the_split_changes_no_logit(tiny_with_tokenizer, split):
    """Streaming heads whose window is every position, without sinks: the original's attention."""
    from transformers import AutoModelForCausalLM

    _, out = split
    ids = torch.randint(0, 1000, (1, 48), generator=torch.Generator().manual_seed(0))
    logits = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, trust_remote_code=True)(ids).logits
              for d in (tiny_with_tokenizer, out)]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-5, rtol=1e-5)
    # transformers without the modeling file (vLLM alike) reads the original model
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(plain).__name__ == "LlamaForCausalLM"
    torch.testing.assert_close(plain(ids).logits, logits[0], atol=1e-5, rtol=1e-5)


def test_the_runtime_serves_the_mix_by_head_and_holds_the_counted_bytes(split):
    from runtime.cache.kv_report import report_variant
    from runtime.engine.engine import Engine, EngineConfig

    heads, out = split
    doc = read_plan(out)
    assert planned_kv_dtype(out) == doc["kv_cache_dtype"] == "int4/int2"
    assert doc["retrieval_kv_heads"] == [list(h) for h in heads.kept]
    engine = Engine.from_checkpoint(out, EngineConfig(max_model_len=CTX, kv_cache_bytes=8 << 20))
    heads_in: dict[str, int] = {}
    for g in engine.kv_spec.groups:
        heads_in[g.kv_dtype] = heads_in.get(g.kv_dtype, 0) + g.num_kv_heads * len(g.layers)
    assert heads_in == {"int4": 2, "int2": 6}
    config = json.loads((out / "config.json").read_text())
    held = report_variant("split", config, heads.kv_dtype, 8 << 20, seq_len=CTX).counted_bytes_per_token
    assert held == pytest.approx(heads.kv_bytes_per_token)
    assert report_variant("int4", config, "int4", 8 << 20, seq_len=CTX).counted_bytes_per_token > held


@pytest.mark.parametrize("kv_dtype,fraction,match", [
    ("int4", 0.25, "HIGH/LOW"), ("int4/int4", 0.25, "HIGH/LOW"), ("int4/int2", 1.0, r"\(0, 1\)"),
    ("int4/int2", 0.0, r"\(0, 1\)"), ("int5/int2", 0.25, "unknown KV dtype")])
def test_bad_requests_are_one_line(tiny_with_tokenizer, kv_dtype, fraction, match):
    with pytest.raises(KvslimError, match=match):
        choose_precision_heads(tiny_with_tokenizer, kv_dtype, fraction, CTX, progress=lambda _: None)


def test_a_windowed_checkpoint_is_refused(split):
    _, out = split
    with pytest.raises(KvslimError, match="full-attention checkpoint"):
        choose_precision_heads(out, "int4/int2", 0.25, CTX, progress=lambda _: None)


def test_the_cli_writes_the_split_and_refuses_what_it_cannot(tiny_with_tokenizer, tmp_path, capsys):
    from cli.main import main

    base = ["convert", str(tiny_with_tokenizer), "--ctx", str(CTX), "--retrieval-samples", "1"]
    assert main([*base, "--kv-cache-dtype", "int4/int2", "--retrieval-heads", "0.5", "-o", str(tmp_path / "a")]) == 0
    assert "4 of 8 KV heads that retrieve" in capsys.readouterr().out
    assert read_plan(tmp_path / "a")["kv_cache_dtype"] == "int4/int2"
    for extra, match in ((["--retrieval-heads", "0.5"], "give --kv-cache-dtype"),
                         (["--kv-cache-dtype", "int4:auto", "--retrieval-heads", "0.5"], "not a variant choice"),
                         (["--kv-cache-dtype", "int4/int2", "--retrieval-heads", "2"], "(0, 1)")):
        assert main([*base, *extra, "-o", str(tmp_path / "b")]) != 0
        err = capsys.readouterr().err.strip()
        assert match in err or pytest.fail(err)
        assert len(err.splitlines()) == 1 and not (tmp_path / "b").exists()


def test_inspect_says_the_lowered_heads_still_attend_to_everything(split):
    from compress.inspection import format_inspection, inspect_checkpoint

    text = format_inspection(inspect_checkpoint(split[1]))
    lowered_layers = sum(1 for h in split[0].lowered if h)
    assert (f"6 of 8 KV heads ({lowered_layers} layers) in a cache group of their own, still attending to everything"
            in text)
    assert "the plan serves it in int2" in text and "streaming heads:" not in text


def test_the_calibration_benchmark_serves_each_row(tiny_with_tokenizer, tmp_path):
    from tests.benchmark_scripts import load_benchmark

    out = tmp_path / "heads.json"
    args = [str(tiny_with_tokenizer), "--rows", "bf16", "0.25@int4/int2", "--ctx", str(CTX), "--samples", "1",
            "--ranking-samples", "1", "--json", str(out)]
    assert load_benchmark("kv_precision_heads_calib").main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["row"] for r in rows] == ["bf16", "0.25@int4/int2"] and all(r["prompts"] == 10 for r in rows)
    assert rows[1]["kv_bytes_per_token"] < rows[0]["kv_bytes_per_token"] and rows[0]["times_smaller"] == 1.0


def test_the_calibration_benchmark_never_measures_a_prompt_it_ranked_on(tiny_with_tokenizer, tmp_path, monkeypatch):
    import eval.kv_plan_measurements as measurements
    import eval.retrieval_logprob as logprob
    from tests.benchmark_scripts import load_benchmark

    ranked, measured = [], []
    monkeypatch.setattr(measurements, "retrieval_rank", lambda _path, _tok, prompts: ranked.extend(prompts) or
                        [(layer, h) for layer in range(4) for h in range(2)])
    real = logprob.answer_ids
    monkeypatch.setattr(logprob, "answer_ids", lambda tok, text, answer: measured.append(text) or real(tok, text, answer))
    args = [str(tiny_with_tokenizer), "--rows", "0.25@int4/int2", "--ctx", str(CTX), "--samples", "2",
            "--ranking-samples", "2", "--tasks", "needle_code_calib", "--ranking-tasks", "needle_code_calib"]
    assert load_benchmark("kv_precision_heads_calib").main(args) == 0
    assert len(measured) == len(ranked) == 10 and not {p.text for p in ranked} & set(measured)
