"""`compress serve` refuses bad input with one line and exit code 2, before listening."""
from __future__ import annotations

import socket

import pytest

from cli.main import main
from foundation.errors import KvslimError
from tests.runtime.server.conftest import HOST, ServerProcess, free_port, serve_argv


def _one_line_exit_2(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv, message", [
    (["serve", "/nonexistent/checkpoint"], "nonexistent"),
    (["serve", "--port", "0"], "--port"),
    (["serve", "--port", "65536"], "--port"),
    (["serve", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["serve", "--max-model-len", "0"], "--max-model-len"),
    (["serve", "--max-model-len", "-4"], "--max-model-len"),
    (["serve", "--max-queue", "0"], "--max-queue"),
    (["serve", "--kv-cache-mib", "0"], "--kv-cache-mib"),
    (["serve", "--threads", "0"], "--threads"),
    (["serve", "--threads", "-1"], "--threads"),
    (["serve", "--threads", str(10**6)], "--threads"),
])
def test_bad_input_is_one_line_exit_2(argv, message, capsys):
    assert message in _one_line_exit_2(argv, capsys)


def test_port_in_use_is_one_line_exit_2(tiny_chat_checkpoint, capsys):
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _one_line_exit_2(["serve", str(tiny_chat_checkpoint), "--host", HOST, "--port", str(port)], capsys)
    assert f"{HOST}:{port}" in err and "in use" in err


def test_bad_host_is_one_line_exit_2(tiny_chat_checkpoint, capsys):
    err = _one_line_exit_2(["serve", str(tiny_chat_checkpoint), "--host", "999.1.1.1"], capsys)
    assert "999.1.1.1:8000" in err


def test_kv_cache_beyond_memory_is_one_line_exit_2(tiny_chat_checkpoint, capsys):
    err = _one_line_exit_2(["serve", str(tiny_chat_checkpoint), "--host", HOST, "--port", str(free_port()),
                            "--kv-cache-mib", "99999999"], capsys)
    assert "99999999 MiB" in err and "memory" in err


def test_max_model_len_past_the_models_context_is_one_line_exit_2(tiny_chat_checkpoint, capsys):
    err = _one_line_exit_2(["serve", str(tiny_chat_checkpoint), "--host", HOST, "--port", str(free_port()),
                            "--max-model-len", str(10**6)], capsys)
    assert "--max-model-len 1000000" in err and "max_position_embeddings" in err


def test_kv_allocation_failure_is_a_kvslim_error(monkeypatch):
    """Where free memory is unknown (or misjudged), the allocator's own failure becomes one line."""
    import runtime.cache.kv_cache as kv_cache
    from foundation.attention_layout import AttentionLayout

    def refuse(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 52428799180800 bytes")

    spec = kv_cache.KVCacheSpec.from_layout(AttentionLayout.from_config(dict(
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, hidden_size=16)), "fp32", block_size=4)
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda: None)
    monkeypatch.setattr(kv_cache.torch, "zeros", refuse)
    with pytest.raises(KvslimError, match="cannot allocate a KV cache of .* MiB"):
        kv_cache.KVCache(spec, (1 << 20,))
    monkeypatch.undo()
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda: 1 << 20)
    with pytest.raises(KvslimError, match=r"does not fit in memory \(1 MiB available\)"):
        kv_cache.KVCache(spec, (1 << 20,))
    assert kv_cache.KVCache(spec, (4,)).num_blocks == (4,)


def test_sigterm_after_a_clean_drain_exits_0(tiny_chat_checkpoint, tmp_path):
    srv = ServerProcess(serve_argv(tiny_chat_checkpoint, "--kv-cache-mib", "4", "--max-model-len", "64"),
                        tmp_path / "server.log")
    assert srv.stop() == 0, srv.log.read_text()[-2000:]


def test_no_tokenizer_is_refused(tmp_path, capsys):
    from tests.tiny_models import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "no-tok", "llama")
    assert main(["serve", str(ckpt)]) == 2
    assert "tokenizer" in capsys.readouterr().err
