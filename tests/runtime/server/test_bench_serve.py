"""`compress bench serve` against the test server, and its pieces."""
from __future__ import annotations

import json
import math

import pytest

from cli.main import main
from eval.bench_serve import dataset_requests, percentiles
from foundation.errors import KvslimError
from tests.runtime.server.conftest import API_KEY, ServerProcess, serve_argv


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
    # the row names the server's KV cache (fp32 KV of the tiny model: 4 layers x K,V x 2 heads x 32 dims x 4 B)
    assert s["server_kv"] == {"kv_dtype": "fp32", "bytes_per_token": 4 * 2 * 2 * 32 * 4}
    out = capsys.readouterr().out
    assert "Output token throughput" in out and "Server KV cache" in out and "fp32, 2048 B/token" in out


def test_bench_serve_against_an_int4_kv_server(tiny_chat_checkpoint, tmp_path, capsys):
    """Requests run through int4 KV blocks (several fill and are quantized); the row names the cache."""
    srv = ServerProcess(serve_argv(tiny_chat_checkpoint, "--kv-cache-dtype", "int4", "--max-num-seqs", "4",
                                   "--max-model-len", "256", "--kv-cache-mib", "4"), tmp_path / "server.log")
    try:
        out = tmp_path / "int4.json"
        assert main(["bench", "serve", "--base-url", srv.base_url, "--num-prompts", "6", "--max-concurrency", "3",
                     "--input-len", "80", "--output-len", "60", "--tokenizer", str(tiny_chat_checkpoint),
                     "--json", str(out)]) == 0
    finally:
        srv.stop()
    s = json.loads(out.read_text())
    assert s["completed"] == 6 and s["total_output_tokens"] == 6 * 60
    # int4 K and V of the tiny model: 4 layers x 2 heads x (2 x 16 B codes + 4 x 2 B / 64 per channel x 32 + 4 B)
    assert s["server_kv"] == {"kv_dtype": "int4", "bytes_per_token": 4 * 2 * (2 * 16 + 2 * 2 * 32 / 64 + 2 * 2)}
    assert "int4, 304 B/token" in capsys.readouterr().out


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
