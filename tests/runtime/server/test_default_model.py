"""`compress serve` with no checkpoint serves the real default model (slow: loads SmolLM2-135M)."""
from __future__ import annotations

import openai
import pytest

from tests.runtime.server.conftest import HOST, ServerProcess


@pytest.mark.slow
def test_default_model_chat_and_kv_metrics(tmp_path, default_model_dir):
    srv = ServerProcess(["-m", "cli.main", "serve", "--host", HOST, "--threads", "1", "--log-level", "warning",
                         "--max-model-len", "512", "--kv-cache-mib", "64", "--dtype", "float32"], tmp_path / "default.log")
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["smollm2"]
        reply = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12, temperature=0)
        assert reply.choices[0].message.content.strip()
        assert reply.usage.prompt_tokens > 10
        m = srv.wait_idle()
        # 30 layers x 3 KV heads x 64 dims x (K, V): fp32 served (--dtype float32: auto depends on the
        # CPU), bf16 for the original (22.5 KiB).
        assert m["kvslim_kv_bytes_per_token"] == 30 * 3 * 64 * 2 * 4
        assert m["kvslim_kv_bytes_per_token_original"] == 30 * 3 * 64 * 2 * 2 == 22.5 * 1024
        assert m['kvslim_kv_blocks_in_use{group="0"}'] == 0
    finally:
        srv.stop()
