"""Pure-Python block accounting for the paged KV cache (no tensors here).

One ``BlockPool`` per cache group: ref-counted physical blocks, an LRU queue of free blocks, and
the prefix-cache index (hash of a full block's tokens, chained through its predecessors -> block).
A freed block keeps its hash until it is handed out again, so a later request with the same
prefix reuses it ("evictable" cached blocks count as free).

``BlockManager`` keeps, per sequence, one block table per group (logical block -> physical id;
``-1`` for blocks a sliding-window group released). A token at position ``p`` is in logical
block ``p // block_size``. Sliding groups only hold the blocks of positions a future query can
still see: the query at ``p`` reads keys ``j`` with ``p - W < j <= p``, and, with S attention
sinks, ``j < S``: the blocks holding the first S positions stay until the sequence ends.

Prefix caching is enabled only when every group is full attention (a hit must be valid in every
group, and a sliding group has already dropped the early blocks).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

from runtime.cache.kv_cache import RELEASED, sink_block_count


class BlockPool:
    """Physical blocks of one cache group."""

    def __init__(self, num_blocks: int, on_free: Callable[[int], None] | None = None):
        self.num_blocks = num_blocks
        self.on_free = on_free  # told each block whose last reference goes
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> physical block

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> int:
        """Pop the least recently freed block (evicting its cached hash, if any)."""
        block, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:
            del self.cached[h]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> None:
        """Take one more reference to a cached block (reviving it if it was free)."""
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} released twice"
        if self.ref_counts[block] == 0:
            self.free_queue[block] = None
            if self.on_free is not None:
                self.on_free(block)

    def register(self, block: int, block_hash: int) -> None:
        """Index a full, computed block under its hash (first holder of a hash wins)."""
        if block_hash not in self.cached and self.block_hash[block] is None:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash


@dataclass(frozen=True)
class PrefixHit:
    """Cached full blocks found for a prompt: ``blocks[g]`` per group and their hashes."""

    num_tokens: int
    blocks: tuple[tuple[int, ...], ...]
    hashes: tuple[int, ...]


def chain_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int, start: int = 0,
                 parents: Sequence[int] = ()) -> list[int]:
    """Hashes of full blocks ``start .. num_blocks-1``; each covers its tokens and its parent's hash."""
    out = list(parents[:start])
    parent = out[-1] if out else 0
    for b in range(start, num_blocks):
        parent = hash((parent, tuple(token_ids[b * block_size:(b + 1) * block_size])))
        out.append(parent)
    return out


class BlockManager:
    """Per-sequence block tables over one ``BlockPool`` per cache group."""

    def __init__(
        self,
        num_blocks: Sequence[int],
        block_size: int,
        windows: Sequence[int | None],
        enable_prefix_caching: bool = True,
        on_free: Callable[[int, int], None] | None = None,
        sinks: Sequence[int] | None = None,
    ):
        """``on_free(group, block)``: told each block that returns to its pool (the cache drops
        state it keeps per block). ``sinks``: attention-sink tokens per group (default none)."""
        if len(num_blocks) != len(windows):
            raise ValueError("one window (or None) per cache group")
        self.block_size = block_size
        self.windows = tuple(windows)
        sinks = tuple(sinks) if sinks is not None else (0,) * len(windows)
        self.sink_blocks = tuple(sink_block_count(s, block_size) for s in sinks)
        self.pools = [BlockPool(n, None if on_free is None else partial(on_free, g)) for g, n in enumerate(num_blocks)]
        self.prefix_caching = enable_prefix_caching and all(w is None for w in windows)
        self.tables: dict[int, list[list[int]]] = {}
        self._hashes: dict[int, list[int]] = {}  # hashes of each sequence's registered full blocks
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    # --- queries -------------------------------------------------------------------------------
    def num_free(self, g: int) -> int:
        return self.pools[g].num_free

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens looked up."""
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    def block_tables(self, seq_id: int) -> list[list[int]]:
        return self.tables[seq_id]

    def _live_start(self, g: int, first_query: int) -> int:
        """First logical block a query at ``first_query`` (or later) can still read in group g."""
        w = self.windows[g]
        return 0 if w is None else max(0, first_query - w + 1) // self.block_size

    def _end_block(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache --------------------------------------------------------------------------
    def no_hit(self) -> PrefixHit:
        return PrefixHit(0, tuple(() for _ in self.pools), ())

    def lookup_prefix(self, token_ids: Sequence[int]) -> PrefixHit:
        """Longest run of cached full blocks at the start of ``token_ids`` (never all of it:
        the last token is always recomputed so the step yields logits)."""
        if not self.prefix_caching:
            return self.no_hit()
        max_blocks = (len(token_ids) - 1) // self.block_size
        hashes = chain_hashes(token_ids, self.block_size, max_blocks)
        blocks: list[list[int]] = [[] for _ in self.pools]
        for h in hashes:
            found = [pool.cached.get(h) for pool in self.pools]
            if any(b is None for b in found):
                break
            for g, b in enumerate(found):
                blocks[g].append(b)
        n = len(blocks[0])
        return PrefixHit(n * self.block_size, tuple(tuple(b) for b in blocks), tuple(hashes[:n]))

    # --- allocation ----------------------------------------------------------------------------
    def can_allocate(self, hit: PrefixHit, num_tokens: int) -> bool:
        """Whether a new sequence reusing ``hit`` can get blocks for its first ``num_tokens``."""
        for g, pool in enumerate(self.pools):
            reused = hit.blocks[g]
            revived = sum(1 for b in reused if pool.ref_counts[b] == 0)
            need = self._end_block(num_tokens) - max(len(reused), self._live_start(g, hit.num_tokens))
            if need > pool.num_free - revived:
                return False
        return True

    def allocate(self, seq_id: int, hit: PrefixHit, num_tokens: int) -> bool:
        """Create ``seq_id``'s tables: the ``hit`` blocks, then fresh blocks up to ``num_tokens``.
        All or nothing: returns False (and changes nothing) when blocks are short."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has blocks")
        if not self.can_allocate(hit, num_tokens):
            return False
        tables = []
        for g, pool in enumerate(self.pools):
            for b in hit.blocks[g]:
                pool.share(b)
            tables.append(list(hit.blocks[g]))
        self.tables[seq_id] = tables
        self._hashes[seq_id] = list(hit.hashes)
        ok = self.append(seq_id, hit.num_tokens, num_tokens)
        assert ok
        return True

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queried_tokens += num_prompt_tokens
        self.prefix_hit_tokens += num_hit_tokens

    def append(self, seq_id: int, first_new: int, num_tokens: int) -> bool:
        """Make sure ``seq_id`` has blocks for positions ``first_new .. num_tokens-1`` and every
        key those queries read. All or nothing: False (nothing changed) when blocks are short."""
        tables = self.tables[seq_id]
        end = self._end_block(num_tokens)
        missing = []
        for g, pool in enumerate(self.pools):
            table = tables[g]
            if self.windows[g] is None:  # a full-attention table only grows: O(1) a decode step
                need = list(range(len(table), end))
            else:  # the sinks and the window, bounded by the window's blocks
                start = self._live_start(g, first_new)
                live = [*range(min(self.sink_blocks[g], start)), *range(start, end)]
                need = [b for b in live if b >= len(table) or table[b] == RELEASED]
            if len(need) > pool.num_free:
                return False
            missing.append(need)
        for g, pool in enumerate(self.pools):
            table = tables[g]
            for b in missing[g]:
                while len(table) <= b:
                    table.append(RELEASED)
                table[b] = pool.allocate()
        return True

    def release_window(self, seq_id: int, num_computed: int) -> int:
        """Free sliding-group blocks no query at ``num_computed`` or later can read; returns count."""
        freed = 0
        for g, pool in enumerate(self.pools):
            if self.windows[g] is None:
                continue
            table = self.tables[seq_id][g]
            for b in range(self.sink_blocks[g], min(self._live_start(g, num_computed), len(table))):
                if table[b] != RELEASED:
                    pool.release(table[b])
                    table[b] = RELEASED
                    freed += 1
        return freed

    def commit_due(self, seq_id: int, num_computed: int) -> bool:
        """Whether ``commit`` has a new full block of ``seq_id`` to index (O(1): most steps have none)."""
        return self.prefix_caching and num_computed // self.block_size > len(self._hashes[seq_id])

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """Index ``seq_id``'s full blocks among its first ``num_computed`` tokens in the prefix cache."""
        if not self.prefix_caching:
            return
        done = self._hashes[seq_id]
        n_full = num_computed // self.block_size
        if n_full <= len(done):
            return
        hashes = chain_hashes(token_ids, self.block_size, n_full, start=len(done), parents=done)
        tables = self.tables[seq_id]
        for b in range(len(done), n_full):
            for g, pool in enumerate(self.pools):
                pool.register(tables[g][b], hashes[b])
        self._hashes[seq_id] = hashes

    def free(self, seq_id: int) -> None:
        """Release every block of ``seq_id`` (tail first, so its prefix stays cached longest)."""
        for g, table in enumerate(self.tables.pop(seq_id)):
            for b in reversed(table):
                if b != RELEASED:
                    self.pools[g].release(b)
        self._hashes.pop(seq_id, None)
