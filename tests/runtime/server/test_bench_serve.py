"""`compress bench serve` against the test server, and its pieces."""
from __future__ import annotations

import json
import math

import pytest

from cli.main import main
from eval.bench_serve import dataset_requests, percentiles
from foundation.errors import KvslimError
from tests.runtime.server.conftest import API_KEY


def test_percentiles_interpolate_like_numpy():
    import numpy as np

    xs = [0.5, 0.1, 0.3, 0.9, 0.7, 0.2]
    p = percentiles(xs)
    assert p["mean"] == pytest.approx(1000 * np.mean(xs))
    assert p["median"] == pytest.approx(1000 * np.percentile(xs, 50))
    assert p["p99"] == pytest.approx(1000 * np.percentile(xs, 99))
    assert all(math.isnan(v) for v in percentiles([]).values())


def test_dataset_lines_are_checked(tmp_path):
    good = tmp_path / "ok.jsonl"
    good.write_text('{"prompt": "a b c", "output_len": 3}\n\n{"prompt": "d"}\n')
    reqs = dataset_requests(good, 2, default_output_len=5)
    assert [(r.prompt, r.output_len) for r in reqs] == [("a b c", 3), ("d", 5)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(KvslimError, match="bad.jsonl:1"):
        dataset_requests(bad, 1, 5)
    with pytest.raises(KvslimError, match="fewer than"):
        dataset_requests(good, 3, 5)


def test_bench_serve_cli_end_to_end(server, tiny_chat_checkpoint, tmp_path, capsys):
    out = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", server.base_url, "--api-key", API_KEY, "--num-prompts", "12",
               "--request-rate", "50", "--max-concurrency", "6", "--input-len", "24", "--output-len", "5",
               "--tokenizer", str(tiny_chat_checkpoint), "--json", str(out)])
    assert rc == 0
    s = json.loads(out.read_text())
    assert s["completed"] == 12 and s["failed"] == 0
    assert s["total_input_tokens"] == 12 * 24 and s["total_output_tokens"] == 12 * 5
    assert s["prompts"].startswith("wikipedia:eval")
    assert 0 < s["ttft_ms"]["median"] <= s["e2el_ms"]["median"]
    assert "Output token throughput" in capsys.readouterr().out


def test_bench_serve_cli_refuses_bad_arguments(capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "2",
                 "--input-len", "8"]) == 2  # neither --request-rate nor --max-concurrency
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "2",
                 "--max-concurrency", "1"]) == 2  # no prompts source
    assert "error" in capsys.readouterr().err
    # a missing dataset is named before any server is contacted (port 9 answers nothing)
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "2",
                 "--max-concurrency", "1", "--dataset", "/nonexistent/prompts.jsonl"]) == 2
    assert "--dataset /nonexistent/prompts.jsonl: no such file" in capsys.readouterr().err
