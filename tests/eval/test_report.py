"""`compress report` on tiny checkpoints: the table, the PNG, the recovery column, bad input."""
from __future__ import annotations

import json

import pytest

from cli.main import main
from eval import results_cache
from tests.tiny_models import make_tiny_checkpoint

ARGS = ["--tasks", "arc_easy,ppl_wikipedia", "--limit", "3", "--ppl-tokens", "200", "--ctx", "128",
        "--kv-budget-gib", "0.01", "--decode-batch", "2", "--decode-tokens", "4"]


@pytest.fixture(scope="module")
def variants(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("report")
    base = make_tiny_checkpoint(root / "tiny", "llama", vocab_size=49152, tokenizer_from=default_model_dir)
    assert main(["quantize", str(base), "--fp8", "--kv-cache-fp8", "--num-calib-samples", "2", "--calib-seq-len", "64",
                 "-o", str(root / "tiny-fp8"), "--no-progress"]) == 0
    assert main(["convert", str(base), "--mqa", "--merge", "mean", "--eval-tokens", "0", "-o", str(root / "tiny-mqa")]) == 0
    return [base, root / "tiny-fp8", root / "tiny-mqa"]


@pytest.fixture(autouse=True)
def private_results(tmp_path, monkeypatch):
    monkeypatch.setattr(results_cache, "results_dir", lambda: tmp_path / "results")


def test_report_table_plot_and_json(variants, tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(["report", *map(str, variants), "--names", "orig,fp8,mqa", *ARGS, "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"plot:  {out / 'report.png'}" in printed
    table = (out / "report.md").read_text()
    assert table in printed
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| checkpoint")]
    assert [r.split(" | ")[0] for r in rows] == ["| orig", "| fp8", "| mqa"]
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "report.json").read_text())
    orig, fp8, mqa = data["rows"]
    # FP8 weights are smaller; FP8 KV (declared by --kv-cache-fp8) halves bf16 KV plus scales; MQA halves 2 KV heads
    assert fp8["weight_bytes"] < orig["weight_bytes"]
    assert fp8["kv_dtype"] == "fp8_e4m3" and orig["kv_dtype"] == "bf16"
    assert mqa["kv_bytes_per_token"] == orig["kv_bytes_per_token"] / 2
    assert mqa["kv_capacity_seqs"] >= 2 * orig["kv_capacity_seqs"] - 1
    assert all(r["decode_tokens_per_s"] > 0 and r["decode_dtype"] in ("float32", "bfloat16") for r in data["rows"])
    assert "wikipedia:eval, first 200 tokens, context 128, stride 64" in table
    assert "Context: 128 tokens for bytes and quality alike" in table
    # the decode column says which path ran: FP8 weights dequantized once on a CPU, FP8 KV
    assert fp8["decode_path"] == "FP8 dequantized once at load, activations FP8 per token (dense GEMM); fp8_e4m3 KV"
    assert orig["decode_path"].startswith("dense GEMM; ")
    assert fp8["resident_weight_bytes"] > fp8["weight_bytes"]  # FP8 resident in the activation dtype


def test_retrieval_beside_perplexity(variants, tmp_path, capsys):
    """Retrieval runs at the report's context, has its own column and the Pareto's second panel,
    and stays out of the mean accuracy and the recovery."""
    out = tmp_path / "rep"
    args = [a if a != "arc_easy,ppl_wikipedia" else "arc_easy,ppl_wikipedia,passkey" for a in ARGS]
    assert main(["report", str(variants[0]), str(variants[2]), "--names", "orig,mqa", *args, "-o", str(out)]) == 0
    orig, mqa = json.loads((out / "report.json").read_text())["rows"]
    assert set(orig["retrieval"]) == {"passkey"} and 0 <= mqa["retrieval"]["passkey"] <= 1
    assert set(orig["accuracy"]) == {"arc_easy"}
    depths = mqa["retrieval_by_depth"]["passkey"]
    assert list(depths) == ["depth0", "depth25", "depth50", "depth75", "depth100"]
    assert sum(depths.values()) / len(depths) == pytest.approx(mqa["retrieval"]["passkey"])  # equal prompts a depth
    table = (out / "report.md").read_text()
    cell = f"{mqa['retrieval']['passkey']:.0%} ({' '.join(f'{100 * a:.0f}' for a in depths.values())})"
    assert "passkey (retrieval; by depth)" in table and cell in table and "128-token prompt" in table
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kv_dtype_rows_and_pareto(variants, tmp_path, capsys):
    """One row per KV dtype of a checkpoint, ratios against the first row, and the Pareto PNG."""
    out = tmp_path / "rep"
    assert main(["report", str(variants[0]), "--names", "orig", "--kv-cache-dtypes", "bf16", "int4", *ARGS,
                 "--ctx", "128", "-o", str(out)]) == 0
    assert f"pareto: {out / 'pareto.png'}" in capsys.readouterr().out
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bf16, int4 = json.loads((out / "report.json").read_text())["rows"]
    assert (bf16["name"], bf16["kv_dtype"], int4["name"], int4["kv_dtype"]) == ("orig bf16", "bf16", "orig int4", "int4")
    assert int4["kv_bytes_per_token"] < bf16["kv_bytes_per_token"] / 3
    assert int4["perplexity"] != bf16["perplexity"]  # int4 KV read back as served
    table = (out / "report.md").read_text()
    assert "| 1.00x |" in table and "context 128" in table


def test_a_checkpoint_at_a_kv_dtype_is_one_row(variants, tmp_path, capsys):
    """``CKPT@KV`` rows sit beside crossed ones: each point of the Pareto names how it was served."""
    out = tmp_path / "rep"
    assert main(["report", f"{variants[0]}@int2", str(variants[2]), "--kv-cache-dtypes", "bf16",
                 *ARGS, "-o", str(out)]) == 0
    rows = json.loads((out / "report.json").read_text())["rows"]
    assert [(r["name"], r["kv_dtype"]) for r in rows] == [("tiny int2", "int2"), ("tiny-mqa", "bf16")]
    assert main(["report", f"{variants[0]}@int3", *ARGS, "-o", str(tmp_path / "bad")]) == 2
    assert "@int3: unknown KV cache dtype 'int3'" in capsys.readouterr().err
    assert main(["report", f"{tmp_path}/absent@int2", *ARGS, "-o", str(tmp_path / "bad")]) == 2
    assert "absent: no such file or directory" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--names", "a"], "--names has 1 names"),
    (["--tasks", "ppl_wikipedia,ppl_pydoc"], "at most one perplexity"),
    (["--decode-batch", "0"], "--decode-batch must be"),
    (["--ctx", "1"], "--ctx must be >= 2"),
])
def test_bad_input_one_line_exit_2(variants, tmp_path, capsys, extra, message):
    out = tmp_path / "rep"
    assert main(["report", str(variants[0]), str(variants[1]), *ARGS, *extra, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists()


def test_existing_output_needs_force(variants, tmp_path, capsys):
    out = tmp_path / "rep"
    out.mkdir()
    assert main(["report", str(variants[0]), *ARGS, "-o", str(out)]) == 2
    assert "--force" in capsys.readouterr().err


def test_recovery_is_mean_ratio_over_tasks_the_baseline_scores():
    from eval.report import CheckpointRow, recovery

    def row(acc):
        return CheckpointRow("x", "x", 1, "bf16", 1.0, 1, None, None, acc, 1.0, "float32", "dense GEMM; bf16 KV", 1)

    base = row({"a": 0.5, "b": 0.8, "c": 0.0})
    assert recovery(base, base) == 1.0
    assert recovery(row({"a": 0.25, "b": 0.8, "c": 0.3}), base) == pytest.approx(0.75)  # c: baseline 0, skipped


def test_decode_timing_counts_decode_steps_only(variants):
    """Prompts longer than a step's token budget prefill in chunks; the timed steps start once every
    request has its first token, each request decodes at each, and none is left running."""
    from eval.report import _decode_steps
    from runtime.engine.engine import Engine, EngineConfig

    engine = Engine.from_checkpoint(variants[0], EngineConfig(dtype="float32", max_num_seqs=3,
                                                              max_num_batched_tokens=64, enable_prefix_caching=False))
    prompts = [[10 + i] * 100 for i in range(3)]
    generated, seconds = _decode_steps(engine, prompts, 5)
    assert generated == 3 * 5 and seconds > 0 and not engine.has_unfinished


def test_no_tasks_measures_bytes_capacity_and_decode_alone(variants, tmp_path):
    out = tmp_path / "rep"
    assert main(["report", str(variants[0]), "--tasks", "", "--ctx", "128", "--kv-budget-gib", "0.01",
                 "--decode-batch", "2", "--decode-tokens", "4", "--decode-prompt-tokens", "100", "-o", str(out)]) == 0
    row = json.loads((out / "report.json").read_text())["rows"][0]
    assert row["accuracy"] == {} and row["retrieval"] == {} and row["perplexity"] is None
    assert row["decode_tokens_per_s"] > 0 and row["kv_capacity_seqs"] > 0
    assert "100-token prompts" in (out / "report.md").read_text()
