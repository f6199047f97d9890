"""`compress serve [CKPT]`: an OpenAI-compatible HTTP server for a (compressed) checkpoint.

    compress serve                              # the default model on http://127.0.0.1:8000
    compress serve out/smollm2-fp8 --kv-cache-dtype fp8 --api-key "$KEY"

Listens on loopback unless ``--host`` says otherwise. SIGTERM (or Ctrl-C) stops accepting
connections, lets in-flight requests finish, then stops the engine; after SIGTERM the exit code is 0.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys
import time
from pathlib import Path

from foundation.errors import KvslimError
from foundation.model_source import DEFAULT_MODEL
from runtime.cache.kv_dtype_choices import KV_CACHE_DTYPE_HELP, cache_kv_dtype, kv_cache_dtype_arg
from runtime.device_choices import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEVICE_HELP,
    DEVICES,
    GPU_MEMORY_HELP,
    KERNELS,
    KERNELS_HELP,
)
from runtime.model.layers.dtype_choices import DTYPE_CHOICES, DTYPE_HELP
from runtime.server.limits import (
    DEFAULT_KEEP_ALIVE_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_READ_TIMEOUT_S,
)

API_KEY_ENV = "KVSLIM_API_KEY"


def add_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", nargs="?", default=None, metavar="CKPT",
                   help=f"checkpoint dir or model name (default: {DEFAULT_MODEL})")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (or set ${API_KEY_ENV})")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    p.add_argument("--kv-cache-dtype", type=kv_cache_dtype_arg, default="auto", help=KV_CACHE_DTYPE_HELP)
    p.add_argument("--device", default="auto", choices=DEVICES, help=DEVICE_HELP)
    p.add_argument("--kernels", default="auto", choices=KERNELS, help=KERNELS_HELP)
    p.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                   help=GPU_MEMORY_HELP)
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests in the running batch")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output in tokens")
    p.add_argument("--max-queue", type=int, default=None,
                   help="most requests held (running + waiting) before answering 429 (default: 4 x max-num-seqs)")
    p.add_argument("--kv-cache-mib", type=int, default=None,
                   help="KV cache budget in MiB (default: 512 on the CPU; on CUDA by --gpu-memory-utilization)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: CKPT's name)")
    p.add_argument("--original", default=None, metavar="CKPT",
                   help="the uncompressed model, for the KV-saving metric (default: the default model when "
                        "serving it, else CKPT's own layout in bf16)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--compile-decode", action="store_true",
                   help="CPU: run decode steps compiled per batch size (1, 2, 4, ... up to --max-num-seqs), all "
                        "compiled at start-up (~30-35 s each for the default model on 2 cores)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: launch every decode step's kernels from Python instead of replaying the CUDA graphs "
                        "captured per batch size at start-up (vLLM's name)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted; a larger one is answered 413 before it is read "
                        f"(default {DEFAULT_MAX_REQUEST_BYTES >> 20} MiB)")
    p.add_argument("--request-read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S,
                   help="seconds a client has to send a whole request (headers and body) once it starts, or "
                        f"after connecting; a stalled connection is closed (default {DEFAULT_READ_TIMEOUT_S:.0f})")
    p.add_argument("--keep-alive-timeout", type=float, default=DEFAULT_KEEP_ALIVE_S,
                   help="seconds an idle connection is kept open between requests "
                        f"(default {DEFAULT_KEEP_ALIVE_S:.0f})")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="most open connections; more are closed as they open, with a 503 "
                        f"(default {DEFAULT_MAX_CONNECTIONS})")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_args(args: argparse.Namespace) -> None:
    """Refuse out-of-range numbers: every count, size and port must be positive (``None``: default)."""
    if not 0 < args.port < 65536:
        raise KvslimError(f"--port must be in 1..65535, got {args.port}")
    for name in ("max_num_seqs", "max_model_len", "max_queue", "kv_cache_mib", "threads", "max_request_bytes",
                 "max_connections"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise KvslimError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    for name in ("request_read_timeout", "keep_alive_timeout"):
        value = getattr(args, name)
        if not 0 < value < float("inf"):
            raise KvslimError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}")
    cpus = os.cpu_count() or 1
    if args.threads is not None and args.threads > cpus:  # more only slows torch down (or hangs it)
        raise KvslimError(f"--threads must be at most {cpus} (this machine's CPUs), got {args.threads}")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` for uvicorn to serve, or a one-line error why not.

    Taken before the engine is built, so a port in use or a bad address fails at once."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: no TIME_WAIT refusal
        sock.bind((host, port))
        sock.listen()
    except OSError as e:  # gaierror (unknown or invalid host) included
        sock.close()
        raise KvslimError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run(args: argparse.Namespace) -> int:
    check_args(args)
    from foundation.model_source import resolve_model

    source = args.checkpoint or DEFAULT_MODEL
    path = resolve_model(source)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise KvslimError(f"{path}: no tokenizer files; the server needs the model's tokenizer")
    from foundation.checkpoint import Checkpoint

    ckpt = Checkpoint.open(path)  # config.json read once: the checks here, then the engine
    positions = ckpt.config.get("max_position_embeddings")
    positions = positions if isinstance(positions, int) else None
    if args.max_model_len is not None and positions is not None and args.max_model_len > positions:
        # vLLM refuses this too: positions past the trained context give garbage, not an error.
        raise KvslimError(f"--max-model-len {args.max_model_len} exceeds the model's context "
                          f"(max_position_embeddings={positions})")
    with bind(args.host, args.port) as sock:
        return _serve(args, sock, ckpt, source)


def _serve(args: argparse.Namespace, sock: socket.socket, ckpt, source: str) -> int:
    """Build the engine and the app, then serve on ``sock`` until SIGTERM / Ctrl-C."""
    import torch
    import uvicorn
    from transformers import AutoTokenizer

    from foundation.attention_layout import AttentionLayout
    from foundation.checkpoint import Checkpoint
    from foundation.model_source import resolve_model
    from runtime.engine.engine import KVBudgetTooSmall
    from runtime.model.loader import live_weight_bytes
    from runtime.server.app import create_app
    from runtime.server.connections import guarded_h11
    from runtime.server.engine_adapter import ThreadedEngine
    from runtime.server.metrics import KVFootprint

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    path = ckpt.path
    try:
        engine = _engine(args, ckpt)
    except KVBudgetTooSmall as e:
        fix = (f"pass --max-model-len {e.longest_fitting} or less, or " if e.longest_fitting else "pass ")
        raise KvslimError(f"a KV cache of {e.budget_bytes >> 20} MiB cannot hold one sequence of max_model_len "
                          f"{e.max_model_len}: {fix}--kv-cache-mib {e.budget_needed >> 20} or more") from None
    if engine.graphs is not None:  # every batch size compiled before the first request, as vLLM captures them
        t0 = time.perf_counter()
        sizes = engine.graphs.compile()
        sys.stderr.write(f"compress serve: decode compiled for batch sizes {', '.join(map(str, sizes))} "
                         f"in {time.perf_counter() - t0:.0f} s\n")
    if engine.cuda_graphs is not None:  # captured before the first request, as vLLM does
        t0 = time.perf_counter()
        sizes = engine.cuda_graphs.capture_all()
        sys.stderr.write(f"compress serve: decode CUDA graphs captured for {len(sizes)} batch sizes "
                         f"(up to {max(sizes)}) in {time.perf_counter() - t0:.1f} s\n")
    tokenizer = AutoTokenizer.from_pretrained(path)

    layout = engine.model.spec.attention
    original_source = args.original or (DEFAULT_MODEL if args.checkpoint is None else None)
    original = layout if original_source is None else AttentionLayout.from_config(
        Checkpoint.open(resolve_model(original_source)).config)
    footprint = KVFootprint.of(engine.kv_spec, layout, original, engine.max_model_len, engine.kv_dtype)

    # A known name (smollm2) is the model id; a directory or file is known by its name.
    model_name = args.served_model_name or (path.name if Path(source).exists() else source)
    max_queue = args.max_queue if args.max_queue is not None else 4 * args.max_num_seqs
    app = create_app(ThreadedEngine(engine), tokenizer, model_name, footprint, api_key=api_key, max_queue=max_queue,
                     max_request_bytes=args.max_request_bytes)
    if not _is_loopback(args.host):
        sys.stderr.write(f"compress serve: listening on {args.host}, reachable from other machines"
                         f"{'' if api_key else ' WITHOUT an API key'}\n")
    url_host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address
    sys.stderr.write(
        f"compress serve: {model_name} ({path}) on http://{url_host}:{args.port}  kv={engine.kv_dtype} "
        f"{footprint.bytes_per_token:.0f} B/token (original in bf16: {footprint.original_bytes_per_token:.0f}), "
        f"max_model_len={engine.max_model_len}, max_num_seqs={args.max_num_seqs}, queue={max_queue}, "
        f"request body <= {args.max_request_bytes} B read within {args.request_read_timeout:g} s, "
        f"keep-alive {args.keep_alive_timeout:g} s, <= {args.max_connections} connections, "
        f"weights {live_weight_bytes(engine.model) / 2**20:.1f} MiB resident, "
        f"activations {engine.model.activation_dtype.describe()}, {engine.model.placement.describe()}\n")
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
        http=guarded_h11(args.request_read_timeout, args.max_connections), timeout_keep_alive=args.keep_alive_timeout))
    # uvicorn drains on SIGTERM, then re-raises it into the handler it found (the default one kills
    # the process: exit 143). This one makes that a no-op, and stops a server not yet serving.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: setattr(server, "should_exit", True))
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _engine(args: argparse.Namespace, ckpt):
    from runtime.engine.engine import Engine, EngineConfig

    return Engine.from_checkpoint(ckpt, EngineConfig(
        dtype=args.dtype,
        kv_dtype=cache_kv_dtype(args.kv_cache_dtype),
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        kv_cache_bytes=None if args.kv_cache_mib is None else args.kv_cache_mib << 20,
        device=args.device,
        kernels=args.kernels,
        gpu_memory_utilization=args.gpu_memory_utilization,
        compile_decode=args.compile_decode,
        enforce_eager=args.enforce_eager,
    ))
