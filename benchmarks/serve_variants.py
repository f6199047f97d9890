"""`compress serve` + `compress bench serve` side by side over checkpoint variants of one model.

Each variant gets its own server process on 127.0.0.1 (started, benchmarked, SIGTERM-drained in
turn, so they never compete); the load is the same for all: ``--num-prompts`` windows of
``--input-len`` tokens of ``wikipedia:eval``, ``--output-len`` tokens each (``ignore_eos``), at
most ``--max-concurrency`` in flight, Poisson arrivals at ``--request-rate``.

    python benchmarks/serve_variants.py original=smollm2 \\
        "fp8=/tmp/smollm2-fp8 --kv-cache-dtype fp8" --json benchmarks/results/serve_variants.json
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a script

import httpx  # noqa: E402

from eval.bench_serve import bench_serve, format_summary  # noqa: E402

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_server(argv: list[str], log: Path, timeout_s: float = 300) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "cli.main", "serve", *argv, "--host", HOST, "--port", str(port),
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {' '.join(cmd)}\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server did not start in {timeout_s:.0f} s: {' '.join(cmd)}")


def kv_metrics(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        for name in ("kvslim_kv_bytes_per_token", "kvslim_kv_bytes_per_token_original"):
            if line.startswith(name + " "):
                out[name] = float(line.split()[1])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", nargs="+", help='NAME=CKPT [serve options], e.g. "fp8=/tmp/x --kv-cache-dtype fp8"')
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--serve-args", default="--max-num-seqs 8 --max-model-len 512 --kv-cache-mib 256 --threads 2",
                   help="options given to every server")
    p.add_argument("--original", default="smollm2", help="the original model, for the KV-saving metric")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()

    rows = []
    for spec in a.variants:
        name, _, rest = spec.partition("=")
        argv = shlex.split(rest) + shlex.split(a.serve_args) + ["--original", a.original]
        log = Path(f"/tmp/serve_variants_{name}.log")
        proc, url = start_server(argv, log)
        try:
            kv = kv_metrics(url)
            s = bench_serve(url, a.num_prompts, a.request_rate, a.max_concurrency, a.input_len, a.output_len,
                            None, a.original)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        print(f"\n== {name}: compress serve {' '.join(argv)}\n{format_summary(s)}")
        rows.append({"name": name, "serve_args": argv, **kv, **asdict(s)})

    print(f"\n{'variant':<14} {'KV B/tok':>9} {'req/s':>6} {'out tok/s':>9} {'TTFT med/p99 ms':>17} "
          f"{'TPOT med/p99 ms':>16} {'ITL med ms':>10} {'fail':>4}")
    for r in rows:
        print(f"{r['name']:<14} {r.get('kvslim_kv_bytes_per_token', float('nan')):>9.0f} "
              f"{r['request_throughput']:>6.2f} {r['output_throughput']:>9.1f} "
              f"{r['ttft_ms']['median']:>8.0f}/{r['ttft_ms']['p99']:<8.0f} "
              f"{r['tpot_ms']['median']:>7.1f}/{r['tpot_ms']['p99']:<8.1f} {r['itl_ms']['median']:>10.1f} "
              f"{r['failed']:>4}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"machine": platform.platform(), "cpu_count": __import__("os").cpu_count(),
                                      "rows": rows}, indent=2) + "\n")
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
