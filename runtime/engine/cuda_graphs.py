"""Decode steps replayed from CUDA graphs, one per batch-size bucket (vLLM's and nano-vllm's recipe).

    graphs = CudaDecodeGraphs(model, backend, DecodeShape(max_rows=64, block_size=16, max_model_len=4096,
                                                          num_groups=1))
    hidden = graphs.run([DecodeRow(token, position, tables), ...])   # one new token per sequence

A small model's decode step is ~1,000 kernel launches: from Python each costs tens of microseconds
of host time, replayed from a graph a few. Every input a step reads lives in a persistent device
buffer (``DecodeInputs``) sized for the largest bucket; a step writes the buffers' pinned host
mirrors, all views of one arena (``StepBuffers``), copies them with one non-blocking copy, then
replays the graph of the smallest bucket (1, 2, 4, 8, 16, 24, ... up to ``max_rows``) that holds
its rows. Padded rows write nowhere (slot -1) and read nothing (context 0: the attention kernel
yields zeros for them and the split merge stays NaN-free). The attention kernels are launched for
the longest context (``max_model_len``) with a split count fixed per bucket; each program reads
only the keys its sequence holds.

Packed int4/int2 groups plan their writes on the host before each replay, as the eager step does
in ``set_batch``: the group's slot table is updated (its changed entries reach the device in a copy
of their own, ``ResidualSlots``) and the plan written per row into the arena (``PackedWriteInputs``,
``WritePlan.per_row_plan``), whose kernels launch over every row of the bucket and skip the rows
that fill or keep nothing.

The captured forward creates no tensor from host data and reads nothing back: a sync inside a
capture is an error on CUDA, and ``tests/runtime/engine/test_cuda_graphs.py`` records it on the
CPU, where ``capture=False`` runs the same static-buffer forward eagerly (Triton's interpreter).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn

from runtime.attention.paged import PagedBatch
from runtime.cache.kv_cache import KVCache
from runtime.cache.residual_slots import ResidualSlots
from runtime.cache.write_plan import WritePlan
from runtime.engine.step_buffers import StepBuffers


def graph_buckets(max_rows: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8 below ``max_rows``, then ``max_rows`` (vLLM's sizes)."""
    sizes = {b for b in (1, 2, 4) if b < max_rows} | set(range(8, max_rows, 8)) | {max_rows}
    return tuple(sorted(sizes))


@dataclass(frozen=True)
class DecodeShape:
    """What the persistent buffers are sized for."""

    max_rows: int  # max_num_seqs
    block_size: int
    max_model_len: int
    num_groups: int  # cache groups (each has its own block table and slots)

    @property
    def table_width(self) -> int:
        """Block-table columns: every logical block of the longest sequence (windows keep theirs, released)."""
        return -(-self.max_model_len // self.block_size)


@dataclass(frozen=True)
class DecodeRow:
    """One decoding sequence: its new token, that token's position, its block table per group."""

    token: int
    position: int
    tables: Sequence[Sequence[int]]  # released window blocks are -1


class PackedWriteInputs:
    """One int4/int2 cache group's per-row write plan (``WritePlan.per_row_plan``) in persistent buffers,
    planned on the host and applied to the group's slot table before each replay."""

    def __init__(self, slots: ResidualSlots, exact_first_block: bool, shape: DecodeShape, buffers: StepBuffers):
        n, bs = shape.max_rows, shape.block_size
        self.slots, self.exact_first_block, self.block_size = slots, exact_first_block, bs
        self.buffers = buffers
        self._full, self._src = buffers.add((n,), torch.long, -1), buffers.add((n, bs), torch.long, -1)
        self._stays, self._full_slots = buffers.add((n,), torch.bool, False), buffers.add((n,), torch.long, -1)
        self._first = buffers.add((n,), torch.bool, False)

    def fill(self, slots: np.ndarray, positions: np.ndarray, bucket: int) -> None:
        """Plan the write of ``slots`` (the real rows; their ``positions``), apply it to the slot
        table, and write it per row on the host, padded to ``bucket``."""
        b = self.buffers
        handles = (self._full, self._src, self._stays, self._full_slots, self._first)
        full, src, stays, full_slots, first = (b.host(h)[:bucket] for h in handles)
        if len(slots):
            plan = self.slots.apply(WritePlan.of(torch.from_numpy(slots.copy()), self.block_size, "cpu",
                                                 torch.from_numpy(positions.copy()), self.exact_first_block))
            rows = plan.per_row_plan(bucket)
            full.copy_(rows.full), src.copy_(rows.src), stays.copy_(rows.stays), full_slots.copy_(rows.full_slots)
            first.copy_(rows.first)
        else:
            full.fill_(-1), src.fill_(-1), stays.fill_(False), full_slots.fill_(-1), first.fill_(False)

    def plan(self, bucket: int) -> WritePlan:
        """The first ``bucket`` rows' plan (views of the device buffers; ``set_batch`` applies nothing)."""
        dev = self.buffers.device
        return WritePlan(full=dev(self._full)[:bucket], src=dev(self._src)[:bucket], stays=dev(self._stays)[:bucket],
                         full_blocks=(), open_blocks=(), closed_blocks=(), first=dev(self._first)[:bucket],
                         full_slots=dev(self._full_slots)[:bucket], refills=True, per_row=True)


class DecodeInputs:
    """The persistent device buffers one decode step reads, and their pinned host mirrors, in one
    arena (``StepBuffers``): a step's inputs reach the device in one copy."""

    def __init__(self, shape: DecodeShape, device: torch.device, cache: KVCache | None = None):
        """``cache``: the engine's, whose int4/int2 groups get per-row write plans (``PackedWriteInputs``)."""
        self.shape = shape
        n, g, w = shape.max_rows, shape.num_groups, shape.table_width
        self.buffers = b = StepBuffers(device)
        self._ids, self._positions = b.add((n,), torch.long, 0), b.add((n,), torch.long, 0)
        self._context_lens = b.add((n,), torch.int32, 0)
        self._slots = [b.add((n,), torch.long, -1) for _ in range(g)]
        self._tables = [b.add((n, w), torch.int32, 0) for _ in range(g)]
        slots = cache.residual_slots if cache is not None else ()
        self._packed = {i: PackedWriteInputs(s, cache.spec.groups[i].exact_first_block, shape, b)
                        for i, s in enumerate(slots) if s is not None}
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token per row
        self.rows = torch.arange(n, dtype=torch.long, device=device)
        # numpy views of the host side, made once: a step writes them without touching torch
        self._np_ids, self._np_positions, self._np_context_lens = (
            b.host(h).numpy() for h in (self._ids, self._positions, self._context_lens))
        self._np_slots = [b.host(h).numpy() for h in self._slots]
        self._np_tables = [b.host(h).numpy() for h in self._tables]

    @property
    def ids(self) -> torch.Tensor:
        return self.buffers.device(self._ids)

    @property
    def positions(self) -> torch.Tensor:
        return self.buffers.device(self._positions)

    def fill(self, rows: Sequence[DecodeRow], bucket: int) -> None:
        """Write ``rows`` then padding up to ``bucket`` on the host (packed write plans too), and
        copy them to the device at once."""
        bs = self.shape.block_size
        ids, pos, ctx = self._np_ids, self._np_positions, self._np_context_lens
        slots, tables = self._np_slots, self._np_tables
        for i, row in enumerate(rows):
            p = row.position
            ids[i], pos[i], ctx[i] = row.token, p, p + 1
            for g, table in enumerate(row.tables):
                tables[g][i, :len(table)] = table
                slots[g][i] = table[p // bs] * bs + p % bs
        n = len(rows)
        ids[n:bucket], pos[n:bucket], ctx[n:bucket] = 0, 0, 0
        for g in range(self.shape.num_groups):
            slots[g][n:bucket] = -1
            tables[g][:bucket].clip(min=0, out=tables[g][:bucket])  # released window blocks are never read
        for g, packed in self._packed.items():
            packed.fill(slots[g][:n], pos[:n], bucket)
        self.buffers.copy_to_device()

    def pad_all(self) -> None:
        """Every row padding (what a capture runs on: it writes and reads nothing)."""
        self.fill((), self.shape.max_rows)

    def batch(self, bucket: int) -> PagedBatch:
        """The first ``bucket`` rows as the attention backends' step metadata (views)."""
        dev = self.buffers.device
        return PagedBatch(
            block_size=self.shape.block_size,
            query_lens=(1,) * bucket,
            first_positions=(0,) * bucket,  # unused by the kernel backend: it reads context_lens
            positions=self.positions[:bucket],
            query_start_loc=self.query_start_loc[:bucket + 1],
            context_lens=dev(self._context_lens)[:bucket],
            block_tables=tuple(dev(t)[:bucket] for t in self._tables),
            slot_mapping=tuple(dev(h)[:bucket] for h in self._slots),
            decode_seqs=self.rows[:bucket],
            decode_rows=self.rows[:bucket],
            write_plans={g: packed.plan(bucket) for g, packed in self._packed.items()},
        )


class CudaDecodeGraphs:
    """A decoder's decode step captured per bucket over ``DecodeInputs`` (``capture=False``: the
    same static-buffer forward run eagerly, for tests without CUDA)."""

    def __init__(self, model: nn.Module, backend, shape: DecodeShape, capture: bool = True):
        """``backend``: the kernel attention backend (``set_batch`` takes a fixed ``max_context_len``)."""
        self.model, self.backend, self.shape = model, backend, shape
        self.capture = capture
        self.buckets = graph_buckets(shape.max_rows)
        self.inputs = DecodeInputs(shape, model.device, backend.cache)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._pool = None
        self.steps = 0  # decode steps run through the static buffers

    @property
    def captured_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def bucket(self, rows: int) -> int:
        for b in self.buckets:
            if b >= rows:
                return b
        raise ValueError(f"{rows} decode rows exceed the largest bucket {self.buckets[-1]}")

    @torch.inference_mode()
    def capture_all(self) -> tuple[int, ...]:
        """Capture every bucket now, largest first (they share one memory pool), as vLLM does at
        start-up; returns the sizes captured."""
        todo = [b for b in reversed(self.buckets) if b not in self._graphs]
        for b in todo:
            self._capture(b)
        return tuple(todo)

    def run(self, rows: Sequence[DecodeRow]) -> torch.Tensor:
        """Final-normed hidden ``[len(rows), hidden]`` of the decode step (``Decoder.forward``'s contract)."""
        return self.replay(self.prepare(rows))[:len(rows)]

    def prepare(self, rows: Sequence[DecodeRow]) -> int:
        """The host's part of a step: capture its bucket if new, write its inputs (and plan its
        packed writes); returns the bucket."""
        b = self.bucket(len(rows))
        if self.capture and b not in self._graphs:
            self._capture(b)
        self.inputs.fill(rows, b)
        self.steps += 1
        return b

    def replay(self, b: int) -> torch.Tensor:
        """The captured part: bucket ``b``'s forward over the inputs ``prepare`` wrote, ``[b, hidden]``."""
        if not self.capture:
            return self._forward(b)
        self._graphs[b].replay()
        return self._outputs[b]

    def _forward(self, b: int) -> torch.Tensor:
        self.backend.set_batch(self.inputs.batch(b), max_context_len=self.shape.max_model_len)
        return self.model(self.inputs.ids[:b], self.inputs.positions[:b], self.backend)

    def _capture(self, b: int) -> None:
        self.inputs.pad_all()  # the warm-up and the capture write and read no cache row
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):  # Triton's compiles and cuBLAS's choices happen outside the graph
            self._forward(b)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._outputs[b] = self._forward(b)
        self._pool = graph.pool()
        self._graphs[b] = graph
