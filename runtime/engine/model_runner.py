"""One step's decoder call (the role of nano-vllm's ``ModelRunner`` and vLLM's ``GPUModelRunner``):
the step's inputs and attention metadata, the forward, then logits and sampling outside it.

A pure decode step replays a CUDA graph per batch-size bucket on a GPU (``runtime.engine.cuda_graphs``:
persistent input buffers filled on the host, then copied at once) or, with ``compile_decode``, runs the
decoder compiled per bucket on the CPU (``runtime.model.decode_graphs``); prefill and mixed steps
run eagerly over ``PagedBatch.build``'s metadata (built on the host, copied to the device once).
"""
from __future__ import annotations

from typing import Sequence

import torch

from runtime.attention.paged import PagedBatch
from runtime.engine.block_manager import BlockManager
from runtime.engine.cuda_graphs import CudaDecodeGraphs, DecodeRow
from runtime.engine.request import Request
from runtime.engine.sampling import TokenLogprob, sample
from runtime.engine.scheduler import ScheduledSeq
from runtime.model.decode_graphs import DecodeGraphs
from runtime.model.decoder import Decoder


class ModelRunner:
    """Runs the decoder on the engine's paged cache through ``backend``."""

    def __init__(self, model: Decoder, backend, block_manager: BlockManager, block_size: int,
                 graphs: DecodeGraphs | None = None, cuda_graphs: CudaDecodeGraphs | None = None):
        """``graphs``: the CPU's compiled decode buckets; ``cuda_graphs``: the GPU's captured ones."""
        self.model, self.backend, self.block_manager = model, backend, block_manager
        self.block_size = block_size
        self.device = model.device
        self.graphs, self.cuda_graphs = graphs, cuda_graphs

    def forward(self, sched: Sequence[ScheduledSeq], graphed: bool = True) -> torch.Tensor:
        """Final-normed hidden states ``[new tokens, hidden]`` of the scheduled sequences, in order.
        ``graphed=False``: no CUDA graph for this step (one that scores prompt tokens)."""
        hidden = self._graphed_decode(sched) if graphed else None
        return hidden if hidden is not None else self._eager_forward(sched)

    def sample(self, last: torch.Tensor, seqs: Sequence[Request],
               generators: Sequence[torch.Generator | None]) -> tuple[list[int], list[TokenLogprob | None]]:
        """Each sequence's next token (and its logprobs when asked) from its last row of hidden states."""
        return sample(self.model.compute_logits(last), [q.sampling for q in seqs], generators)

    def _graphed_decode(self, sched: Sequence[ScheduledSeq]) -> torch.Tensor | None:
        """Hidden states of a pure decode step replayed from a CUDA graph, or None where the step is
        not one (a prefill chunk in it, no graphs on this engine, more rows than the largest bucket)."""
        graphs = self.cuda_graphs
        if graphs is None or len(sched) > graphs.shape.max_rows or any(s.num_new_tokens != 1 for s in sched):
            return None
        tables = self.block_manager.block_tables
        return graphs.run([DecodeRow(s.seq.token_slice(s.first_position, s.first_position + 1)[0], s.first_position,
                                     tables(s.seq.seq_id)) for s in sched])

    def _eager_forward(self, sched: Sequence[ScheduledSeq]) -> torch.Tensor:
        ids: list[int] = []
        for s in sched:
            ids.extend(s.seq.token_slice(s.first_position, s.first_position + s.num_new_tokens))
        batch = PagedBatch.build(
            self.block_size,
            [s.first_position for s in sched],
            [s.num_new_tokens for s in sched],
            [self.block_manager.block_tables(s.seq.seq_id) for s in sched],
            self.device,
        )
        self.backend.set_batch(batch)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        if self.graphs is not None and len(ids) == len(sched):  # a pure decode step, compiled on the CPU
            return self.graphs.run(input_ids, batch.positions, self.backend)
        return self.model(input_ids, batch.positions, self.backend)

    def score_piece(self, ids: Sequence[int], start: int, tables: Sequence[Sequence[int]],
                    exact_new_rows: bool = False, skip: int = 0) -> torch.Tensor:
        """fp32 logits ``[len(ids) - skip, vocab]`` of one piece of a sequence scored through the
        cache (``Engine.score``): tokens ``ids`` at positions from ``start``, its blocks ``tables``;
        the first ``skip`` rows get none. ``exact_new_rows``: FP8/INT8 tokens read the piece's new
        rows exact, as a served prefill does; else each its own row exact and its context as stored,
        as decoded (packed KV reads an open block exact either way)."""
        batch = PagedBatch.build(self.block_size, [start], [len(ids)], [tables], self.device, exact_new_rows=exact_new_rows)
        self.backend.set_batch(batch)
        step_ids = torch.tensor(list(ids), dtype=torch.long, device=self.device)
        return self.model.compute_logits(self.model(step_ids, batch.positions, self.backend)[skip:])
