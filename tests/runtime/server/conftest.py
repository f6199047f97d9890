"""Real server processes on 127.0.0.1 for the server tests (never any other address)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.tiny_models import make_tiny_checkpoint

HOST = "127.0.0.1"
API_KEY = "test-key"
STARTUP_S = 120.0
REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server subprocess on loopback; ``stop()`` sends SIGTERM and waits for the drain."""

    def __init__(self, argv: list[str], log: Path, api_key: str | None = None):
        self.port = free_port()
        self.base_url = f"http://{HOST}:{self.port}"
        self.api_key = api_key
        self.log = log
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        self._log_file = open(log, "wb")
        self.proc = subprocess.Popen([sys.executable, *argv, "--port", str(self.port)], cwd=REPO, env=env,
                                     stdout=self._log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(f"server did not start in {STARTUP_S:.0f} s:\n{self.log.read_text()[-3000:]}")

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of /metrics, and labelled ones as ``name{labels}``."""
        text = httpx.get(f"{self.base_url}/metrics", headers=self.headers, timeout=10).text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?) ([-+.\deEinfNa]+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, float]:
        """Poll /metrics until no request runs or waits and no KV block is in use."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if (m["kvslim_num_requests_running"] == 0 and m["kvslim_num_requests_waiting"] == 0
                    and m['kvslim_kv_blocks_in_use{group="0"}'] == 0):
                return m
            if time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log_file.close()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log_file.close()


@pytest.fixture(scope="session")
def tiny_chat_checkpoint(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random Llama with the default model's tokenizer and chat template."""
    out = make_tiny_checkpoint(tmp_path_factory.mktemp("serve") / "tiny-chat", "llama", vocab_size=49152,
                               tokenizer_from=default_model_dir)
    template = default_model_dir / "chat_template.jinja"
    if template.is_file():
        shutil.copy2(template, out / template.name)
    return out


def serve_argv(checkpoint: Path, *extra: str) -> list[str]:
    """``compress serve`` in a subprocess, with float32 activations (``auto`` depends on the CPU)."""
    return ["-m", "cli.main", "serve", str(checkpoint), "--host", HOST, "--threads", "1",
            "--log-level", "warning", "--dtype", "float32", *extra]


@pytest.fixture(scope="session")
def server(tiny_chat_checkpoint, tmp_path_factory):
    """The real engine on the tiny checkpoint, behind an API key."""
    srv = ServerProcess(serve_argv(tiny_chat_checkpoint, "--api-key", API_KEY, "--max-num-seqs", "8",
                                   "--max-model-len", "256", "--max-queue", "256", "--kv-cache-mib", "16",
                                   "--served-model-name", "tiny"),
                        tmp_path_factory.mktemp("log") / "server.log", api_key=API_KEY)
    yield srv
    srv.stop()
