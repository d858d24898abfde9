"""The CDSP scheduler (seed 001, Tetris): the paper's worked examples, Eq. 1's fit, Eq. 2 and
the properties every plan must have."""

import math
import random
import sys
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medha_jax.scheduler.cdsp import (TABLE1_LLAMA3_8B_A100, AdaptiveImprovementRate,
                                      CdspConfig, CdspScheduler, DecodeRouter,
                                      FixedSpScheduler, ImprovementRateTable, LatencyModel,
                                      book_chunk, book_plan, fit_latency_models,
                                      table1_latency_models, table1_tabulated)
from medha_jax.scheduler import cdsp, cdsp_search
from medha_jax.scheduler.cdsp_search import NONE, Groups


def test_section_2_4_first_example_greedy_sp16_versus_reserving_8_instances():
    # 16 Llama-3 8B instances (TP=1), each with a 1 s queue; a 32k then a 16k request.
    ttfts = {}
    for r in (0.0, 0.05):
        scheduler = CdspScheduler(16, table1_tabulated(), CdspConfig(improvement_rate=r))
        queues = [1.0] * 16
        plans = []
        for tokens in (32 * 1024, 16 * 1024):
            plans.append(scheduler.plan(tokens, queues))
            book_plan(queues, plans[-1])
        ttfts[r] = tuple(round(p.ttft_s, 2) for p in plans), tuple(p.sp_sizes for p in plans)
    # r = 0 is LoongServe's greedy choice: SP16 for the 32k, the 16k waits for it.
    assert ttfts[0.0] == ((1.53, 1.84), ((16,), (8,)))
    # A 5% improvement rate keeps the 32k at SP8 and leaves the other node to the 16k.
    assert ttfts[0.05] == ((1.58, 1.31), ((8,), (8,)))
    (a1, a2), (b1, b2) = ttfts[0.0][0], ttfts[0.05][0]
    assert round((a1 + a2) / 2 - (b1 + b2) / 2, 2) == 0.24
    assert round(max(a1, a2) - max(b1, b2), 2) == 0.26


def test_section_2_4_second_example_chunks_fill_the_idle_node():
    # A 16k request already runs at SP8; a 128k request arrives.
    models = table1_tabulated()
    queues = [0.0] * 16
    whole = CdspScheduler(16, models, CdspConfig(improvement_rate=0.0, chunking=False))
    book_plan(queues, whole.plan(16 * 1024, queues))
    assert sorted(queues) == [0.0] * 8 + [pytest.approx(0.31)] * 8
    sp16 = whole.plan(128 * 1024, queues)
    assert sp16.sp_sizes == (16,)
    assert sp16.chunks[0].start_s == pytest.approx(0.31)     # 8 instances idle for 0.31 s
    assert sp16.ttft_s == pytest.approx(2.62)
    sp8 = CdspScheduler(16, models, CdspConfig(sp_sizes=(8,))).plan(128 * 1024, queues)
    assert sp8.ttft_s - sp16.ttft_s == pytest.approx(1.34)   # SP8 on the idle 8: +1.34 s
    # CDSP fills the 0.31 s with a first chunk on the idle node, then grows to 16.
    cdsp = CdspScheduler(16, models, CdspConfig(improvement_rate=0.0)).plan(128 * 1024, queues)
    assert cdsp.sp_sizes == (8, 16)
    assert cdsp.chunks[0].start_s == 0.0
    assert cdsp.chunks[0].end_s == pytest.approx(0.31)
    assert cdsp.ttft_s == pytest.approx(0.31 + 2.31 - 0.46)  # F16(128k) - F16(16k)
    assert cdsp.ttft_s < sp16.ttft_s


def test_fit_recovers_known_coefficients_per_sp_size():
    truth = {4: LatencyModel(4, 0.05, 2e-5, 7e-10, 4e-10),
             16: LatencyModel(16, 0.4, 3e-6, 1e-10, 6e-11)}
    rng = random.Random(0)
    samples = []
    for sp, m in truth.items():
        for _ in range(40):
            tokens, history = rng.randint(256, 131072), rng.choice([0, rng.randint(1, 200_000)])
            samples.append((tokens, history, sp, m.seconds(history, tokens)))
    fitted = fit_latency_models(samples)
    assert set(fitted) == set(truth)
    for sp, m in truth.items():
        for name in ("alpha", "beta", "gamma", "delta"):
            assert getattr(fitted[sp], name) == pytest.approx(getattr(m, name), rel=1e-6), name


def test_fit_with_noise_stays_close_and_table1_fit_is_within_ten_percent():
    truth = LatencyModel(8, 0.17, 7e-6, 3e-10, 1.6e-10)
    rng = random.Random(1)
    samples = [(t, h, 8, truth.seconds(h, t) * rng.uniform(0.97, 1.03))
               for t, h in ((rng.randint(1024, 131072), rng.randint(0, 131072))
                            for _ in range(200))]
    fitted = fit_latency_models(samples)[8]
    for t, h in ((4096, 0), (32768, 65536), (131072, 131072)):
        assert fitted.seconds(h, t) == pytest.approx(truth.seconds(h, t), rel=0.03)
    for sp, m in table1_latency_models().items():
        for tokens, seconds in TABLE1_LLAMA3_8B_A100[sp]:
            assert m.seconds(0, tokens) == pytest.approx(seconds, rel=0.1), (sp, tokens)


def test_fit_rejects_bad_samples_naming_the_problem():
    with pytest.raises(ValueError, match="sp=2: need >= 4"):
        fit_latency_models([(100, 0, 2, 1.0)] * 3)
    with pytest.raises(ValueError, match="seconds must be finite and > 0"):
        fit_latency_models([(100, 0, 2, 0.0)])
    with pytest.raises(ValueError, match="LatencyModel.gamma"):
        LatencyModel(1, 0.0, 1.0, -1.0, 0.0)


@given(st.floats(0, 0.5), st.floats(0, 1e-4), st.floats(0, 1e-8), st.floats(1e-12, 1e-8),
       st.integers(0, 500_000), st.floats(0.0, 30.0))
def test_tokens_within_is_the_root_of_eq1(alpha, beta, gamma, delta, history, budget):
    m = LatencyModel(1, alpha, beta, gamma, delta)
    tokens = m.tokens_within(history, budget)
    if budget <= alpha:
        assert tokens == 0.0
    else:
        assert m.seconds(history, tokens) == pytest.approx(budget, rel=1e-9, abs=1e-12)


def test_book_chunk_is_eq2():
    queues = [0.5, 2.0, 1.0, 0.0]
    assert book_chunk(queues, (0, 2), 3.0) == (1.0, 4.0)
    assert queues == [4.0, 2.0, 4.0, 0.0]


def test_extend_follows_the_papers_two_rules():
    # Three nodes of 4: node 0 has one idle instance, node 1 is free in 1 s, node 2 in 2 s.
    queues = [0.0, 5.0, 5.0, 5.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 0.5]
    pool = Groups(queues, node_size=4, aligned=False, sp_sizes=list(range(17)))

    def grow(*sizes):
        """Extend from the empty group through `sizes`: (members, longest added queue)."""
        key, added = 0, None   # 0: the empty group
        for s in sizes:
            key, added = pool.extend(key, s)   # sp_sizes[s] is s
            if key == NONE:
                return None
        return pool.members(key), added

    # (1) first chunk within a node: the node whose s-th shortest queue is shortest.
    assert grow(1) == ((0,), 0.0)
    assert grow(2) == ((4, 5), 1.0)
    # ... spanning nodes: whole nodes by their longest queue, the rest by the rule above.
    assert grow(8) == ((4, 5, 6, 7, 8, 9, 10, 11), 2.0)
    assert grow(5) == ((0, 4, 5, 6, 7), 1.0)
    # (2) growing a group: its own nodes first, even where other nodes are free sooner.
    assert grow(1, 2) == ((0, 1), 5.0)
    assert grow(1, 6) == ((0, 1, 2, 3, 4, 5), 5.0)
    assert grow(1, 4, 12)[0] == tuple(range(12))
    assert grow(16) is None


@st.composite
def pools(draw):
    nodes = draw(st.integers(1, 4))
    queues = draw(st.lists(st.floats(0, 5), min_size=8 * nodes, max_size=8 * nodes))
    return queues, draw(st.integers(1, 300_000)), draw(st.floats(0, 0.75)), draw(st.booleans())


@settings(max_examples=60, deadline=None)
@given(pools())
def test_every_plan_has_nested_groups_positive_chunks_and_eq2_times(case):
    queues, tokens, r, aligned = case
    n = len(queues)
    scheduler = CdspScheduler(n, table1_latency_models(),
                              CdspConfig(improvement_rate=r, aligned=aligned))
    plan = scheduler.plan(tokens, queues)
    assert sum(c.tokens for c in plan.chunks) == tokens
    assert all(c.tokens > 0 for c in plan.chunks)
    state = list(queues)
    history = 0
    for prev, c in zip((None,) + plan.chunks, plan.chunks):
        assert len(set(c.group)) == c.sp and all(0 <= i < n for i in c.group)
        if prev is not None:
            assert set(prev.group) <= set(c.group) and prev.sp < c.sp
        if aligned:
            assert c.sp & (c.sp - 1) == 0 and c.group == tuple(range(c.group[0],
                                                                      c.group[0] + c.sp))
            assert c.group[0] % c.sp == 0
        assert c.history == history
        history += c.tokens
        start, end = book_chunk(state, c.group, scheduler.models[c.sp].seconds(c.history,
                                                                              c.tokens))
        assert (c.start_s, c.end_s) == (pytest.approx(start), pytest.approx(end))
    assert plan.ttft_s == pytest.approx(max(state[i] for i in plan.chunks[-1].group))


@settings(max_examples=40, deadline=None)
@given(pools())
def test_chunking_never_predicts_a_later_first_token_than_one_chunk(case):
    queues, tokens, r, aligned = case
    config = CdspConfig(improvement_rate=r, aligned=aligned)
    models = table1_latency_models()
    chunked = CdspScheduler(len(queues), models, config).plan(tokens, queues)
    single = CdspScheduler(len(queues), models,
                           CdspConfig(improvement_rate=r, aligned=aligned, chunking=False)
                           ).plan(tokens, queues)
    assert chunked.ttft_s <= single.ttft_s + 1e-12


@st.composite
def odd_pools(draw):
    """Pools of any size and node size (a short last node, a pool of 24 with one aligned
    block of 16), with ties among the queues."""
    n = draw(st.integers(1, 40))
    queues = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0, 5),
                           min_size=n, max_size=n))
    return (queues, draw(st.sampled_from([1, 2, 3, 4, 8])), draw(st.integers(1, 300_000)),
            draw(st.floats(0, 0.75)), draw(st.booleans()), draw(st.booleans()))


@pytest.mark.skipif(not cdsp.PLANNER_COMPILED,
                    reason="the CDSP planner was not compiled at install (no mypyc or no C "
                           "compiler): the source is what runs")
@settings(max_examples=150, deadline=None)
@given(odd_pools())
def test_the_compiled_planner_plans_exactly_as_its_source(case):
    queues, node_size, tokens, r, aligned, tabulated = case
    models = table1_tabulated() if tabulated else table1_latency_models()
    config = CdspConfig(node_size=node_size, aligned=aligned, improvement_rate=r)
    compiled = CdspScheduler(len(queues), models, config)
    source = CdspScheduler(len(queues), models, config, planner=cdsp_search)
    assert type(compiled._search).__module__ == "medha_jax.scheduler._cdsp_search_compiled"
    assert type(source._search).__module__ == "medha_jax.scheduler.cdsp_search"
    assert compiled.plan(tokens, queues) == source.plan(tokens, queues)


def test_a_compiled_planner_built_from_other_source_is_not_used(monkeypatch):
    stale = types.ModuleType("medha_jax.scheduler._cdsp_search_compiled")
    stale.SOURCE_SHA256 = "0" * 64
    monkeypatch.setitem(sys.modules, "medha_jax.scheduler._cdsp_search_compiled", stale)
    with pytest.warns(UserWarning, match="older cdsp_search.py"):
        assert cdsp._planner_module() is cdsp_search


def test_aligned_groups_of_a_first_chunk_pick_the_block_free_first():
    queues = [3.0] * 4 + [0.0] * 2 + [9.0] * 2 + [1.0] * 8
    scheduler = CdspScheduler(16, table1_latency_models(),
                              CdspConfig(aligned=True, chunking=False, sp_sizes=(4,)))
    assert scheduler.plan(8192, queues).chunks[0].group == (8, 9, 10, 11)
    # A pool of 24 has one aligned block of 16, [0, 16): a group in [16, 24) cannot grow to 16.
    scheduler = CdspScheduler(24, table1_latency_models(),
                              CdspConfig(aligned=True, improvement_rate=0.0))
    assert scheduler.plan(200_000, [5.0] * 16 + [0.0] * 8).chunks[0].group == tuple(range(16, 24))
    # The idle [16, 24) cannot take a first chunk that grows to 16: one chunk on [0, 16).
    plan = scheduler.plan(200_000, [0.5] * 16 + [0.0] * 8)
    assert [c.group for c in plan.chunks] == [tuple(range(16))]


def test_fixed_sp_sends_a_request_whole_to_the_group_free_first():
    scheduler = FixedSpScheduler(16, 8, table1_tabulated()[8])
    plan = scheduler.plan(32768, [2.0] * 8 + [1.0] * 8)
    assert plan.chunks[0].group == tuple(range(8, 16))
    assert plan.ttft_s == pytest.approx(1.58)
    with pytest.raises(ValueError, match="must divide"):
        FixedSpScheduler(16, 6, table1_tabulated()[8])


def test_improvement_rate_follows_the_sliding_window_every_update_period():
    table = ImprovementRateTable((0.5, 1.0, 2.0), (0.1, 0.3, 0.7))
    assert table.lookup(0.0) == 0.1 and table.lookup(1.4) == 0.3 and table.lookup(9) == 0.7
    adaptive = AdaptiveImprovementRate(table, window_s=60, update_every_s=30)
    rates = [adaptive.observe(t / 2) for t in range(0, 200)]   # 2 req/s for 100 s
    assert rates[0] == 0.1                  # nothing observed yet: the lightest load's
    assert rates[1] == rates[59] == 0.7     # cold start: 2 req/s from the arrivals so far
    assert rates[60] == 0.7                 # t = 30 s: 61 arrivals in 30 s, about 2 req/s
    # Then one arrival per 10 s: the window keeps the old rate until it is updated at a
    # period boundary (every 30 s), after which the 60 s window sees about 0.1 req/s.
    rates = [adaptive.observe(100 + 10 * k) for k in range(1, 13)]
    assert rates[0] == 0.7 and rates[-1] == 0.1
    with pytest.raises(ValueError, match="ascending"):
        ImprovementRateTable((2.0, 1.0), (0.1, 0.2))


def test_decode_router_counts_transfers_as_virtual_usage():
    router = DecodeRouter([100, 100])
    assert router.route("a", 40) == 0           # both empty: ties to the lower index
    # Instance 0's batch is still empty but 40 of its slots are virtual: same freeness (inf),
    # so the tie breaks low again -- unless it has no room.
    assert router.route("b", 70) == 1
    router.transfer_done("a")
    router.transfer_done("b")
    assert router.freeness(0) == 60 and router.freeness(1) == 30
    assert router.route("c", 10) == 0
    assert router.route("d", 80) is None        # no instance has 80 free slots
    router.finish("b")
    assert router.freeness(1) == math.inf
    router.finish("c")                          # finished before landing: virtual freed
    assert router.virtual == [0, 0] and router.used == [40, 0]


def _pinned_plans_digest(aligned: bool, trials: int = 60) -> str:
    """A digest of every plan (tokens, history, group, start, end, exact floats) over random
    queue states at pools of 8..128 (and 24, 96: pools that are no power of two): uniform
    queues, queues with many ties (few distinct values, idle instances) and the queues a
    pool has after booking the plans before. Hand-set Eq. 1 coefficients (no fit, so no
    BLAS in the numbers), SP 1..128, each doubling as in benchmarks.cdsp's timing models."""
    import hashlib

    models = {1: LatencyModel(1, 0.03, 5.6e-05, 2.5e-09, 1.3e-09),
              2: LatencyModel(2, 0.026, 3.0e-05, 1.2e-09, 6.1e-10),
              4: LatencyModel(4, 0.058, 1.6e-05, 6.1e-10, 3.0e-10),
              8: LatencyModel(8, 0.17, 6.7e-06, 3.3e-10, 1.6e-10),
              16: LatencyModel(16, 0.39, 2.5e-06, 1.8e-10, 9.0e-11)}
    for s in (32, 64, 128):
        m = models[s // 2]
        models[s] = LatencyModel(s, m.alpha * 1.5, m.beta / 2, m.gamma / 2, m.delta / 2)
    digest = hashlib.sha256()
    for n in (8, 16, 24, 32, 64, 96, 128):
        rng = random.Random(n * 7 + aligned)
        scheduler = CdspScheduler(n, models, CdspConfig(aligned=aligned))
        booked = [0.0] * n
        for k in range(trials):
            kind = k % 3
            if kind == 0:
                queues = [rng.uniform(0, 5) for _ in range(n)]
            elif kind == 1:
                queues = [rng.choice((0.0, 0.0, 0.5, 1.0, 2.5)) for _ in range(n)]
            else:
                queues = booked
            tokens = rng.randint(1, 260_000)
            r = rng.choice((0.0, 0.05, 0.1, 0.3, 0.75))
            plan = scheduler.plan(tokens, queues, r)
            digest.update(repr((n, k, [(c.tokens, c.history, c.group, c.start_s, c.end_s)
                                       for c in plan.chunks])).encode())
            if kind == 2:
                book_plan(booked, plan)
                dt = rng.uniform(0, 3)
                booked = [max(0.0, q - dt) for q in booked]
    return digest.hexdigest()


@pytest.mark.parametrize("aligned, expected", [
    (False, "f4fd1381046a3f26ce56108466f51d53eebdf8cfc9af16f3e8b4ca68bddf7923"),
    (True, "51eedccb8fe3207d8f4dd13ce89612643e5a5a1550df408f3f9360783513e756")])
def test_plans_are_pinned_across_scheduler_optimisations(aligned, expected):
    # The plans of the scheduler as first written (commit c90875f), pinned so a faster
    # search is proven to return the same plan, chunk for chunk, to the last bit.
    assert _pinned_plans_digest(aligned) == expected
