"""`compress convert` through the CLI: a good run, and bad input (one line, exit 2, nothing written)."""
import json
import shutil

import pytest

from cli.main import main


def test_convert_writes_checkpoint_and_summary(tiny_llama, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["convert", str(tiny_llama), "--mqa", "--merge", "mean", "--kv-share", "2", "--sliding-window", "16",
               "--global-every", "2", "--eval-tokens", "0", "-o", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "KiB/token" in text and "KV heads" in text
    config = json.loads((out / "config.json").read_text())
    assert config["num_key_value_heads"] == 1 and config["sliding_window"] == 16
    assert config["num_sink_tokens"] == 4  # the default with a window


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, tiny_checkpoints):
    path = tmp_path_factory.mktemp("q") / "quantized"
    shutil.copytree(tiny_checkpoints["llama"], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors"}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def with_sinks(tmp_path_factory, tiny_checkpoints):
    path = tmp_path_factory.mktemp("s") / "sinks"
    shutil.copytree(tiny_checkpoints["mistral"], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_sink_tokens": 2}))
    return path


BAD = {
    "heads_not_dividing": ("llama", ["--kv-heads", "3"], "does not divide"),
    "heads_not_fewer": ("llama", ["--kv-heads", "2"], "conflicts"),
    "share_zero": ("llama", ["--kv-share", "0"], "between 2"),
    "share_one": ("llama", ["--kv-share", "1"], "groups of 1 share nothing"),
    "share_too_many": ("llama", ["--kv-share", "5"], "between 2"),
    "share_select_without_share": ("llama", ["--mqa", "--kv-share-select", "calib"], "needs --kv-share"),
    "global_select_without_window": ("llama", ["--mqa", "--global-select", "calib"], "needs --sliding-window"),
    "calib_unused": ("llama", ["--mqa", "--merge", "mean", "--calib", "wikipedia:calib"], "nothing here reads calibration"),
    "calib_unused_share": ("llama", ["--kv-share", "2", "--merge", "aligned", "--calib", "wikipedia:calib"],
                           "--kv-share with --merge calib"),
    "calib_eval_text": ("llama", ["--mqa", "--calib", "wikipedia:eval"], "is a eval range"),
    "calib_missing_file": ("llama", ["--mqa", "--calib", "no/such/text.txt"], "not found"),
    "calib_without_tokenizer": ("llama", ["--mqa"], "no tokenizer files"),
    "heal_steps_zero": ("llama", ["--mqa", "--merge", "mean", "--heal-steps", "0"], "--heal-steps must be at least 1"),
    "empty_global_layers": ("llama", ["--sliding-window", "16", "--global-layers", ","], "layer indices"),
    "negative_eval_tokens": ("llama", ["--mqa", "--eval-tokens", "-5"], "--eval-tokens"),
    "window_at_context": ("llama", ["--sliding-window", "512", "--global-every", "2"], "below the model's context"),
    "window_without_globals": ("llama", ["--sliding-window", "16"], "exactly one of"),
    "globals_out_of_range": ("llama", ["--sliding-window", "16", "--global-layers", "1,9"], "distinct layers"),
    "already_sliding": ("mistral", ["--sliding-window", "16", "--global-every", "2"], "conflicts"),
    "sinks_without_window": ("llama", ["--mqa", "--sinks", "4"], "needs --sliding-window"),
    "negative_sinks": ("llama", ["--sliding-window", "16", "--global-every", "2", "--sinks", "-1"], "0 or more"),
    "sinks_twice": ("sinks", ["--sinks", "2"], "existing attention sinks"),
    "already_mqa": ("gemma3_text", ["--mqa"], "conflicts"),
    "gemma_share": ("gemma3_text", ["--kv-share", "2"], "not supported"),
    "nothing": ("llama", [], "nothing to convert"),
    "quantized": ("quantized", ["--mqa"], "convert first, then quantize"),
    "plan_with_rewrites": ("llama", ["--kv-budget", "0.5", "--sliding-window", "16"], "drop --sliding-window"),
    "plan_budget_zero": ("llama", ["--kv-budget", "0"], "in (0, 1]"),
    "plan_both_ways": ("llama", ["--kv-budget", "0.5", "--max-ppl-increase", "0.1"], "not allowed with"),
    "plan_negative_increase": ("llama", ["--max-ppl-increase", "-0.1"], "0 or more"),
    "plan_past_context": ("llama", ["--kv-budget", "0.5", "--ctx", "100000"], "model's context"),
    "plan_sliding_model": ("mistral", ["--kv-budget", "0.5", "--ctx", "64"], "full-attention checkpoint"),
    "ctx_without_plan": ("llama", ["--mqa", "--ctx", "64"], "--ctx applies to a KV plan"),
    "plan_quantized": ("quantized", ["--kv-budget", "0.5", "--ctx", "64"], "plan the KV layout on unquantized"),
    "streaming_without_window": ("llama", ["--streaming-heads", "0.5"], "needs --sliding-window"),
    "streaming_fraction_above_1": ("llama", ["--streaming-heads", "1.5", "--sliding-window", "16"], "in [0, 1]"),
    "streaming_fraction_text": ("llama", ["--streaming-heads", "half", "--sliding-window", "16"], "or auto"),
    "streaming_with_globals": ("llama", ["--streaming-heads", "0.5", "--sliding-window", "16", "--global-every", "2"],
                               "drop --global-every"),
    "streaming_with_mqa": ("llama", ["--streaming-heads", "0.5", "--sliding-window", "16", "--mqa"], "merge or share"),
    "streaming_window_at_context": ("llama", ["--streaming-heads", "0.5", "--sliding-window", "512"],
                                    "below the model's context"),
    "streaming_sliding_model": ("mistral", ["--streaming-heads", "0.5", "--sliding-window", "16"], "every layer here"),
    "plan_with_streaming": ("llama", ["--kv-budget", "0.5", "--streaming-heads", "0.5"], "drop --streaming-heads"),
    "kv_dtype_with_rewrites": ("llama", ["--kv-cache-dtype", "int4", "--mqa"], "drop --mqa"),
    "kv_dtype_with_budget": ("llama", ["--kv-cache-dtype", "int4", "--kv-budget", "0.5"], "not allowed with"),
    "kv_dtype_unknown": ("llama", ["--kv-cache-dtype", "int5"], "unknown KV cache dtype"),
    "kv_dtype_unknown_variant": ("llama", ["--kv-cache-dtype", "int4:sideways"], "unknown KV variant"),
    "kv_dtype_variant_of_int8": ("llama", ["--kv-cache-dtype", "int8:exact-first-block"], "apply to packed KV"),
    "kv_dtype_auto": ("llama", ["--kv-cache-dtype", "auto"], "name a KV dtype"),
    "kv_dtype_choose_a_chosen": ("llama", ["--kv-cache-dtype", "int4:keys-unrotated+auto"], "unknown KV variant 'auto'"),
    "kv_dtype_no_prompts": ("llama", ["--kv-cache-dtype", "int4:auto", "--retrieval-samples", "0"], "at least 1"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_one_line_exit_2_nothing_written(case, tiny_checkpoints, quantized, with_sinks, tmp_path, capsys):
    arch, flags, message = BAD[case]
    src = {"quantized": quantized, "sinks": with_sinks}.get(arch) or tiny_checkpoints[arch]
    out = tmp_path / "out"
    try:
        rc = main(["convert", str(src), "--eval-tokens", "0", *flags, "-o", str(out)])
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and err.count("\n") == 1
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_refuses_existing_output(tiny_llama, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    assert main(["convert", str(tiny_llama), "--mqa", "--merge", "mean", "--eval-tokens", "0", "-o", str(out)]) == 2


def test_plan_writes_plan_json_that_inspect_prints(tiny_with_tokenizer, tmp_path, capsys):
    """At context 64 no window fits below it: the planner chooses the KV dtype alone."""
    out = tmp_path / "planned"
    assert main(["convert", str(tiny_with_tokenizer), "--kv-budget", "0.5", "--ctx", "64", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "x smaller than the bf16 original" in text and "dev perplexity" in text
    plan = json.loads((out / "plan.json").read_text())
    assert plan["kv_bytes_per_token"] <= 0.5 * plan["original_kv_bytes_per_token"]
    assert plan["sliding_window"] is None and plan["kv_cache_dtype"] in ("int8", "int4", "int2")
    assert main(["inspect", str(out)]) == 0
    assert f"served with {plan['kv_cache_dtype']} KV by default" in capsys.readouterr().out


def test_sinks_on_trained_windows_print_a_note(tiny_checkpoints, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["convert", str(tiny_checkpoints["gemma3_text"]), "--sinks", "2", "--eval-tokens", "0",
                 "-o", str(out)]) == 0
    assert "trained with these sliding windows" in capsys.readouterr().out


def test_aligned_merge_calibrates_on_text(tiny_with_tokenizer, tmp_path, capsys):
    out = tmp_path / "aligned"
    assert main(["convert", str(tiny_with_tokenizer), "--mqa", "--merge", "aligned", "--eval-tokens", "0", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "MQA (aligned merge)" in text and "wikipedia:calib" in text
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 1


def test_a_plan_with_a_kv_dtype_mix_is_inspected_and_served(tiny_with_tokenizer, tmp_path, capsys):
    """plan.json naming FULL/WINDOWED: inspect says which group is served in which dtype, and the
    runtime's auto KV dtype serves the mix."""
    from runtime.llm import LLM

    out = tmp_path / "streaming"
    assert main(["convert", str(tiny_with_tokenizer), "--streaming-heads", "0.5", "--sliding-window", "8",
                 "--eval-tokens", "0", "-o", str(out)]) == 0
    (out / "plan.json").write_text(json.dumps({"kv_cache_dtype": "int8/int2", "ctx": 64}))
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "the plan serves it in int8" in text and "the plan serves it in int2" in text
    llm = LLM(out, max_model_len=64)
    assert llm.kv_cache_dtype == "int8/int2"
    assert {(g.kind, g.kv_dtype) for g in llm.kv_spec.groups} == {("full", "int8"), ("sliding", "int2")}


def test_kv_cache_dtype_writes_a_plan_the_runtime_serves(tiny_llama, tmp_path, capsys):
    from runtime.llm import LLM

    out = tmp_path / "int4"
    assert main(["convert", str(tiny_llama), "--kv-cache-dtype", "int4:exact-first-block", "--ctx", "256",
                 "-o", str(out)]) == 0
    assert "x smaller than the bf16 original" in capsys.readouterr().out
    plan = json.loads((out / "plan.json").read_text())
    assert plan["kv_cache_dtype"] == "int4:exact-first-block" and plan["ctx"] == 256
    assert (out / "model.safetensors").read_bytes() == (tiny_llama / "model.safetensors").read_bytes()
    assert main(["inspect", str(out)]) == 0
    assert "served with int4:exact-first-block KV by default" in capsys.readouterr().out
    llm = LLM(out, max_model_len=64)
    assert llm.kv_cache_dtype == "int4:exact-first-block" and llm.kv_spec.groups[0].exact_first_block


def test_kv_cache_dtype_auto_chooses_a_variant_on_calibration_prompts(tiny_with_tokenizer, tmp_path, capsys):
    from eval.kv_variant_choice import VariantCandidate, pick

    out = tmp_path / "chosen"
    assert main(["convert", str(tiny_with_tokenizer), "--kv-cache-dtype", "int4:auto", "--ctx", "128",
                 "--retrieval-samples", "1", "-o", str(out)]) == 0
    plan = json.loads((out / "plan.json").read_text())
    measured = [VariantCandidate(**c) for c in plan["candidates"]]
    assert [c.kv_dtype for c in measured] == ["int4", "int4:exact-first-block", "int4:keys-unrotated",
                                              "int4:exact-first-block+keys-unrotated"]
    assert plan["kv_cache_dtype"] == pick(measured).kv_dtype
    assert plan["retrieval_prompts"].startswith("10 prompts (passkey_calib, needle_calib, 1 a depth")
    assert "calibration answer log-prob" in capsys.readouterr().out
