"""`compress eval` end to end on tiny checkpoints (and, marked slow, the real default model)."""
import json
import shutil

import pytest
import torch

from cli.main import main
from eval import results_cache

TINY_ARGS = ["--tasks", "arc_easy,boolq", "ppl_pydoc", "--limit", "4", "--ppl-tokens", "300", "--batch-size", "4"]


@pytest.fixture(autouse=True)
def private_results(tmp_path, monkeypatch):
    monkeypatch.setattr(results_cache, "results_dir", lambda: tmp_path / "results")
    return tmp_path / "results"


def test_tiny_scores_are_deterministic_and_parsed_back(tiny_with_tokenizer, private_results, capsys):
    assert main(["eval", str(tiny_with_tokenizer), *TINY_ARGS]) == 0
    out = capsys.readouterr().out
    first = results_cache.EvalResults.from_json(next(private_results.glob("*.json")).read_text())
    assert list(first.scores) == ["arc_easy", "boolq", "ppl_pydoc"]
    assert first.scores["arc_easy"].num_samples == 4 and first.scores["arc_easy"].stderr is not None
    assert first.scores["ppl_pydoc"].detail.startswith("pydoc:eval, first 300 tokens")
    for s in first.scores.values():  # every score is in the printed table
        assert f"{s.value:.4f}" in out or f"{s.value:.3f}" in out
    # a second run (not from the cache) gives the very same scores
    assert main(["eval", str(tiny_with_tokenizer), *TINY_ARGS, "--no-cache"]) == 0
    second = results_cache.EvalResults.from_json(next(private_results.glob("*.json")).read_text())
    assert second.scores == first.scores
    # A third run, against itself as baseline, is served from the cache. A random model is at
    # chance everywhere: no task carries signal, so nothing is gated and nothing can fail.
    capsys.readouterr()
    assert main(["eval", str(tiny_with_tokenizer), "--baseline", str(tiny_with_tokenizer), *TINY_ARGS]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("cached:") == 2
    assert captured.out.count("not gated") == 3


def test_modeling_code_not_ours_is_refused(tiny_with_tokenizer, tmp_path, capsys):
    ckpt = shutil.copytree(tiny_with_tokenizer, tmp_path / "with_code")
    (ckpt / "modeling_evil.py").write_text("import os\n")
    assert main(["eval", str(ckpt), *TINY_ARGS]) == 2
    err = capsys.readouterr().err
    assert "modeling_evil.py" in err and len(err.strip().splitlines()) == 1


def test_our_modeling_file_runs_a_tampered_one_is_refused(tiny_with_tokenizer, tmp_path, capsys):
    out = tmp_path / "shared"
    convert = ["convert", str(tiny_with_tokenizer), "-o", str(out), "--kv-share", "2", "--merge", "mean",
               "--kv-share-select", "first", "--eval-tokens", "0"]
    assert main(convert) == 0
    assert (out / "modeling_kvslim.py").is_file()
    args = ["--tasks", "arc_easy", "--limit", "2", "--batch-size", "2"]
    assert main(["eval", str(out), *args]) == 0
    tampered = shutil.copytree(out, tmp_path / "tampered")
    with (tampered / "modeling_kvslim.py").open("a") as f:
        f.write("# changed\n")
    capsys.readouterr()
    assert main(["eval", str(tampered), *args]) == 2
    assert "modeling_kvslim.py is not one of kvslim's modeling files" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", "mmlu"], "unknown task"),
        (["--limit", "0"], "--limit"),
        (["--backend", "vllm"], "unknown backend"),
        (["--baseline", "x", "--scheme", "W3A3"], "no gate for scheme"),
        (["--scheme", "W3A3"], "no gate for scheme"),
        (["--scheme", "FP8_DYNAMIC"], "needs --baseline"),
        (["--tasks", ","], "no task names"),
        (["--tasks", "arc_easy", "--baseline", "/nonexistent/kvslim-baseline"], "no such file"),
        (["--tasks", "ppl_wikipedia", "--ppl-tokens", "999999999"], "has only"),
    ],
)
def test_bad_flags_exit_2_with_one_line(tiny_with_tokenizer, capsys, args, message):
    assert main(["eval", str(tiny_with_tokenizer), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_missing_checkpoint_exit_2(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nope")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_truncated_checkpoint_exit_2_before_any_work(tiny_with_tokenizer, tmp_path, capsys):
    bad = shutil.copytree(tiny_with_tokenizer, tmp_path / "bad")
    weights = next(bad.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-100])
    assert main(["eval", str(bad), "--tasks", "arc_easy", "--limit", "2"]) == 2
    err = capsys.readouterr().err
    assert "truncated" in err and len(err.strip().splitlines()) == 1


def _broken_copy(src, out):
    """The default model with its (tied) embedding rows shuffled: same shapes, garbage model."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    for f in src.glob("*.safetensors"):
        tensors = load_file(f)
        g = torch.Generator().manual_seed(0)
        for name, t in tensors.items():
            if name.endswith("embed_tokens.weight"):
                tensors[name] = t[torch.randperm(t.shape[0], generator=g)].contiguous()
        save_file(tensors, out / f.name, metadata={"format": "pt"})
    return out


@pytest.mark.slow
def test_broken_checkpoint_fails_its_gate(default_model_dir, tmp_path, capsys):
    args = ["--tasks", "lambada_openai", "ppl_pydoc", "--limit", "40", "--ppl-tokens", "512"]
    broken = _broken_copy(default_model_dir, tmp_path / "broken")
    assert main(["eval", str(broken), "--baseline", str(default_model_dir), *args]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out
    # the model against itself passes (both results now come from the cache)
    assert main(["eval", str(default_model_dir), "--baseline", str(default_model_dir), *args]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "pass" in out


USER_TEXT = "The quick brown fox jumps over the lazy dog. " * 40


@pytest.mark.parametrize("backend", ["hf", "kvslim"])
def test_text_file_alone_at_a_context_writes_json(tiny_with_tokenizer, tmp_path, capsys, backend):
    text = tmp_path / "mine.txt"
    text.write_text(USER_TEXT)
    out = tmp_path / "out" / "scores.json"
    args = ["eval", str(tiny_with_tokenizer), "--text", str(text), "--ctx", "64", "--json", str(out),
            "--backend", backend]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    scores = doc["results"]["scores"]
    assert list(scores) == ["ppl_text"]  # with --text and no --tasks, only that perplexity runs
    row = scores["ppl_text"]
    assert row["detail"] == f"{text.resolve()}, first {row['num_samples']} tokens, context 64, stride 32"
    assert row["value"] > 1 and row["num_samples"] > 64
    assert doc["results"]["settings"]["text_file"]["sha256"]
    assert f"{row['value']:.3f}" in capsys.readouterr().out
    # a changed file is a new measurement, never a cached one
    text.write_text(USER_TEXT + "And then some more words.")
    assert main(args) == 0
    assert json.loads(out.read_text())["results"]["scores"]["ppl_text"]["num_samples"] > row["num_samples"]


def test_text_file_beside_tasks_and_a_baseline(tiny_with_tokenizer, tmp_path):
    text = tmp_path / "mine.txt"
    text.write_text(USER_TEXT)
    out = tmp_path / "scores.json"
    assert main(["eval", str(tiny_with_tokenizer), "--tasks", "ppl_pydoc", "--ppl-tokens", "200", "--text", str(text),
                 "--ctx", "128", "--baseline", str(tiny_with_tokenizer), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["results"]["scores"]) == ["ppl_pydoc", "ppl_text"]
    assert doc["results"]["scores"]["ppl_pydoc"]["detail"].endswith("context 128, stride 64")
    assert {g["task"] for g in doc["gates"]} == {"ppl_pydoc", "ppl_text"}
    assert doc["baseline"]["scores"].keys() == doc["results"]["scores"].keys()


def _bad_texts(tmp_path):
    empty, binary, folder = tmp_path / "empty.txt", tmp_path / "latin1.txt", tmp_path / "folder"
    empty.write_text("  \n")
    binary.write_bytes("caf\xe9".encode("latin-1"))
    folder.mkdir()
    return {"empty": (empty, "is empty"), "binary": (binary, "not UTF-8"), "folder": (folder, "is a directory"),
            "missing": (tmp_path / "none.txt", "no such file")}


@pytest.mark.parametrize("case", ["empty", "binary", "folder", "missing"])
def test_bad_text_file_exit_2_with_one_line(tiny_with_tokenizer, tmp_path, capsys, case):
    path, message = _bad_texts(tmp_path)[case]
    assert main(["eval", str(tiny_with_tokenizer), "--text", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ctx", "100000"], "longer than the model's"),
        (["--ctx", "1"], "--ctx must be >= 2"),
        (["--tasks", "ppl_text"], "give it with --text FILE"),
        (["--json", "/"], "--json /: is a directory"),
    ],
)
def test_bad_context_or_text_task_exit_2(tiny_with_tokenizer, tmp_path, capsys, args, message):
    text = tmp_path / "mine.txt"
    text.write_text(USER_TEXT)
    extra = [] if "ppl_text" in args else ["--text", str(text)]
    assert main(["eval", str(tiny_with_tokenizer), *args, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
