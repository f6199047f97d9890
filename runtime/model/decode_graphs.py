"""The decode step compiled once per batch-size bucket, as vLLM captures a few fixed batch sizes.

    graphs = DecodeGraphs(model, max_num_seqs=32)
    hidden = graphs.run(input_ids, positions, backend)   # a pure decode step: one token per sequence

A decode step's rows are padded to the next bucket (1, 2, 4, 8, ... up to ``max_num_seqs``) and run
through ``torch.compile`` (inductor) built for that bucket's static shapes, so the step's small ops
(norms, rotary, residuals, activations, splits) fuse into a few loops and run without Python
between them. Two things stay eager inside the compiled graph, each behind an opaque custom op:
attention (``kvslim::attend``: its shapes follow every sequence's context and it writes the cache),
and ``torch._int_mm`` (``kvslim::int_mm`` in ``runtime.model.layers.linear``: under compile it
measured 19 ms against 47 us eager).
The graph's wrapper is C++ (inductor's ``cpp_wrapper``) and the weights are frozen into it.
Padded rows carry token 0 at position 0; attention sees only the real rows and returns zeros for
the others, which are sliced off. Prefill and mixed steps run eagerly. Each bucket compiles on its
first use (~30-35 s for the default model on 2 cores), or all of them at once by ``compile()``.
"""
from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

from foundation.errors import KvslimError
from runtime.attention.backend import AttentionBackend


# Each DecodeGraphs by its handle, the one value its compiled graphs carry to the opaque op (an op
# takes tensors and scalars, not a backend): the op asks that instance for the step it is running.
_GRAPHS: "weakref.WeakValueDictionary[int, DecodeGraphs]" = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


@torch.library.custom_op("kvslim::attend", mutates_args=())
def _attend(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_idx: int,
            graphs: int) -> torch.Tensor:
    owner = _GRAPHS.get(graphs)
    assert owner is not None and owner.step is not None, "kvslim::attend outside DecodeGraphs.run"
    backend, n = owner.step
    out = backend.attend(layer_idx, q[:n], None if k is None else k[:n], None if v is None else v[:n])
    if n == q.shape[0]:
        return out.contiguous()
    padded = q.new_zeros(q.shape)
    padded[:n] = out
    return padded


@_attend.register_fake
def _(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_idx: int, graphs: int) -> torch.Tensor:
    return torch.empty_like(q)


class _NullAttention:
    """Attention that attends nothing and writes no cache: what ``DecodeGraphs.compile`` traces through."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        return torch.zeros_like(q)


class _OpaqueAttention:
    """The backend the compiled decoder sees: every ``attend`` is one ``kvslim::attend`` call for
    the ``DecodeGraphs`` of handle ``graphs``."""

    def __init__(self, graphs: int) -> None:
        self.graphs = graphs

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.kvslim.attend(q, k, v, layer_idx, self.graphs)


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two below ``max_num_seqs``, then ``max_num_seqs`` itself."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return (*sizes, max_num_seqs)


class DecodeGraphs:
    """A decoder's decode step compiled per bucket (``torch.compile``, static shapes, freezing)."""

    def __init__(self, model: nn.Module, max_num_seqs: int) -> None:
        """``model``: a ``Decoder`` on the CPU (on CUDA the cost is the kernels' launches: CUDA graphs,
        not built yet)."""
        if model.device.type != "cpu":
            raise KvslimError(f"--compile-decode (compile_decode) runs on the CPU only, not {model.device.type}")
        self.model = model
        self.buckets = decode_buckets(max_num_seqs)
        # False before a bucket compiles: its wrapper in Python, slower but with each op visible to
        # torch.profiler (benchmarks/decode_profile.py); buckets already compiled keep theirs.
        self.cpp_wrapper = True
        self._compiled = torch.compile(model.forward, dynamic=False, fullgraph=True)
        self._ready: set[int] = set()  # buckets compiled
        handle = next(_HANDLES)
        _GRAPHS[handle] = self
        self._opaque = _OpaqueAttention(handle)
        self.step: tuple[AttentionBackend, int] | None = None  # while a step runs: its backend and real rows
        # Every bucket is one more entry in Decoder.forward's compile cache (and so is every other
        # engine's model in this process): past torch's default of 8, fullgraph would refuse.
        self._limits = torch._dynamo.config.patch(recompile_limit=1 << 16, accumulated_recompile_limit=1 << 16)
        self.steps = 0  # decode steps run compiled

    @property
    def compiled_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._ready))

    def bucket(self, rows: int) -> int:
        """The smallest bucket that holds ``rows``."""
        for b in self.buckets:
            if b >= rows:
                return b
        raise ValueError(f"{rows} decode rows exceed the largest bucket {self.buckets[-1]}")

    @torch.inference_mode()  # as the engine's steps run: grad mode is part of what a graph is compiled for
    def compile(self, up_to: int | None = None) -> tuple[int, ...]:
        """Compile now every bucket a step of at most ``up_to`` rows can take (default: all), as vLLM
        captures its sizes at start-up, so that no step waits on a compile; returns those compiled."""
        last = self.buckets[-1] if up_to is None else self.bucket(up_to)
        todo = tuple(b for b in self.buckets if b <= last and b not in self._ready)
        for b in todo:
            ids = torch.zeros(b, dtype=torch.long, device=self.model.device)
            # two tensors, as a step passes: the same tensor twice would compile for aliased inputs
            self._forward(ids, ids.clone(), _NullAttention(), b)
        return todo

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """Final-normed hidden ``[rows, hidden]`` of a decode step (``Decoder.forward``'s contract)."""
        n = input_ids.shape[0]
        b = self.bucket(n)
        if b > n:
            input_ids = torch.nn.functional.pad(input_ids, (0, b - n))
            positions = torch.nn.functional.pad(positions, (0, b - n))
        hidden = self._forward(input_ids, positions, backend, n)
        self.steps += 1
        return hidden[:n]

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend,
                 rows: int) -> torch.Tensor:
        b = input_ids.shape[0]
        self.step = (backend, rows)
        try:
            if b in self._ready:
                with self._limits:
                    return self._compiled(input_ids, positions, self._opaque)
            try:
                # Freezing: the weights are constants of the graph. The C++ wrapper: the graph's calls
                # are made from C++, not from a generated Python function (0.7-3 ms a step less at
                # batch 1 in interleaved runs, for ~10 s more compiling per bucket).
                with self._limits, torch._inductor.config.patch(freezing=True, cpp_wrapper=self.cpp_wrapper):
                    hidden = self._compiled(input_ids, positions, self._opaque)
            except KvslimError:
                raise
            except Exception as e:  # e.g. inductor's CPU code needs a C++ compiler on the machine
                first = (str(e).strip().splitlines() or [""])[0]
                raise KvslimError(f"compile_decode: torch.compile of the decode step failed for batch size {b} "
                                  f"({type(e).__name__}: {first}); serve without --compile-decode") from None
            self._ready.add(b)
            return hidden
        finally:
            self.step = None
