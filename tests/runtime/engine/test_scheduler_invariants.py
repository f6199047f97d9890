"""Hypothesis: the scheduler and block manager under random arrivals, lengths, aborts, shared
prefixes and tight block pools (forcing preemption). A content model checks that every block a
sequence reads holds that sequence's tokens (so prefix hits and reuse are sound)."""
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.engine.block_manager import RELEASED, BlockManager
from runtime.engine.request import Request, RequestStatus
from runtime.engine.scheduler import Scheduler, SchedulerConfig

MAX_MODEL_LEN = 48
STOP = 1
PREFIXES = [[], list(range(100, 111)), list(range(200, 206))]

request = st.tuples(
    st.integers(0, 12),  # arrival step
    st.sampled_from(range(len(PREFIXES))),
    st.integers(1, 20),  # own prompt tokens
    st.integers(1, 12),  # max_tokens
    st.one_of(st.none(), st.integers(0, 30)),  # abort step
)


def fake_token(seq: Request) -> int:
    h = (seq.seq_id * 7919 + seq.num_tokens * 104729) % 97
    return STOP if h == 0 else 2 + h % 50


def check_pools(bm: BlockManager, running):
    for g, pool in enumerate(bm.pools):
        counts = Counter(b for s in running for b in bm.tables[s.seq_id][g] if b != RELEASED)
        for b in range(pool.num_blocks):
            assert pool.ref_counts[b] == counts.get(b, 0), f"group {g} block {b}"
            assert (b in pool.free_queue) == (pool.ref_counts[b] == 0)
        if not bm.prefix_caching:
            assert all(c == 1 for c in counts.values()), "a block owned twice"
        for h, b in pool.cached.items():
            assert pool.block_hash[b] == h


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request, min_size=1, max_size=14),
    block_size=st.sampled_from([1, 2, 4]),
    extra_blocks=st.integers(0, 20),
    window=st.one_of(st.none(), st.integers(2, 9)),
    prefix_caching=st.booleans(),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 24),
)
def test_scheduler_invariants(reqs, block_size, extra_blocks, window, prefix_caching, max_num_seqs, budget):
    full_need = -(-MAX_MODEL_LEN // block_size)
    windows = [None] if window is None else [None, window]
    sizes = [full_need + extra_blocks] * len(windows)
    if window is not None:  # the sliding pool: the transient need of one chunk, plus extra
        sizes[1] = min(full_need, -(-(window - 1 + budget + block_size - 1) // block_size)) + extra_blocks
    bm = BlockManager(sizes, block_size, windows, prefix_caching)
    sched = Scheduler(SchedulerConfig(max_num_seqs, budget, MAX_MODEL_LEN), bm)
    seqs = []
    for i, (arrive, pre, n, max_tokens, abort) in enumerate(reqs):
        prompt = PREFIXES[pre] + [300 + i * 20 + j for j in range(n)]
        seqs.append((arrive, abort, Request(i, prompt, max_tokens, frozenset({STOP}))))
    content: dict[tuple[int, int], dict[int, int]] = {}
    added, step = set(), 0
    while step < 2000:
        for arrive, abort, seq in seqs:
            if arrive == step:
                sched.add(seq)
                added.add(seq.seq_id)
            if abort == step and seq.seq_id in added and not seq.is_finished:
                assert sched.abort(seq.seq_id) is seq
                assert seq.status == RequestStatus.FINISHED_ABORTED
        if not sched.has_unfinished and step > 12:
            break
        out = sched.schedule()
        if sched.has_unfinished:
            assert out.scheduled or out.preempted, "deadlock: nothing scheduled"
        assert out.num_tokens <= budget and len(sched.running) <= max_num_seqs
        assert len({s.seq.seq_id for s in out.scheduled}) == len(out.scheduled)
        check_pools(bm, sched.running)
        sampled = {}
        for s in out.scheduled:
            seq, tokens = s.seq, s.seq.token_ids
            tables = bm.block_tables(seq.seq_id)
            end = s.first_position + s.num_new_tokens
            for g, table in enumerate(tables):
                for p in range(s.first_position, end):  # "write" the new tokens
                    content.setdefault((g, table[p // block_size]), {})[p % block_size] = tokens[p]
                lo = 0 if windows[g] is None else max(0, s.first_position - windows[g] + 1)
                for p in range(lo, end):  # every key the chunk reads holds this sequence's token
                    assert table[p // block_size] != RELEASED
                    assert content[(g, table[p // block_size])][p % block_size] == tokens[p]
            if s.samples:
                sampled[seq.seq_id] = fake_token(seq)
        sched.postprocess(out, sampled)
        check_pools(bm, sched.running)
        step += 1
    assert not sched.has_unfinished, "requests left unfinished"
    assert added == {s.seq_id for _, _, s in seqs}
    for _, abort, seq in seqs:
        assert seq.is_finished
        if seq.status == RequestStatus.FINISHED_LENGTH:
            assert len(seq.output_token_ids) == seq.max_tokens or seq.num_tokens == MAX_MODEL_LEN
        elif seq.status == RequestStatus.FINISHED_STOPPED:
            assert seq.output_token_ids[-1] == STOP and STOP not in seq.output_token_ids[:-1]
        else:
            assert abort is not None
        # Recompute after preemption never changes already generated tokens.
        assert all(t == STOP or 2 <= t < 52 for t in seq.output_token_ids)
    for g, pool in enumerate(bm.pools):
        assert pool.num_free == pool.num_blocks and not any(pool.ref_counts)
    assert not bm.tables


def test_shared_prompt_is_computed_once():
    bm = BlockManager([64], 4, [None], True)
    sched = Scheduler(SchedulerConfig(8, 256, 128), bm)
    system = list(range(10, 42))  # 32 tokens = 8 blocks
    first = Request(0, system + [1000, 1001], 2)
    sched.add(first)
    out = sched.schedule()
    sched.postprocess(out, {0: 5})
    others = [Request(i, system + [2000 + i], 2) for i in range(1, 4)]
    for s in others:
        sched.add(s)
    out = sched.schedule()
    new = {s.seq.seq_id: (s.first_position, s.num_new_tokens) for s in out.scheduled}
    for s in others:
        assert new[s.seq_id] == (32, 1) and s.num_cached_tokens == 32
    assert bm.prefix_hit_rate == (3 * 32) / (34 + 3 * 33)
    # The 8 system-prompt blocks are shared by all four sequences.
    shared = bm.block_tables(0)[0][:8]
    for s in others:
        assert bm.block_tables(s.seq_id)[0][:8] == shared
    assert all(bm.pools[0].ref_counts[b] == 4 for b in shared)


def test_preemption_by_recompute_keeps_outputs():
    bm = BlockManager([6], 2, [None], False)  # 12 token slots
    sched = Scheduler(SchedulerConfig(4, 64, 12), bm)
    a, b = Request(0, [1, 2, 3, 4], 6), Request(1, [5, 6, 7, 8], 6)
    sched.add(a)
    sched.add(b)
    preempted = 0
    for _ in range(100):
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        preempted += len(out.preempted)
        sched.postprocess(out, {s.seq.seq_id: 9 for s in out.scheduled if s.samples})
    assert preempted >= 1 and b.num_preemptions >= 1
    assert a.output_token_ids == [9] * 6 and b.output_token_ids == [9] * 6
    assert bm.num_free(0) == 6
