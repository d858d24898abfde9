"""The CDSP prefill pool as a Server's prefill stage (serving.prefill_pool): prompts with a
full page are prefilled on a 2-device ring and decoded on the replica, with one replica's
greedy tokens; the rest bypass it; cancels and bad configs; every page comes back."""

import dataclasses
import gc
import time

import jax
import numpy as np
import pytest

from medha_jax import SamplingParams
from serving import pool_handoff
from medha_jax.scheduler.cdsp import CdspScheduler, LatencyModel
from serving.prefill_pool import (IMPROVEMENT_RATE_CANDIDATES, PROFILED_LOADS,
                                  PrefillPoolConfig, profile_improvement)
from serving.server import Server, TokensPrompt
from tests.test_replicas import tiny_model
from tests.test_server import TINY_ENGINE, wait_until_idle

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PAGE = TINY_ENGINE.page_size
# Lengths: under a page (bypasses the pool), exactly a page and a token, a few pages, and
# more than one device's steps take at once.
LENGTHS = (9, 17, 45, 70, 100)
PROMPTS = [TokensPrompt([int(t) for t in np.random.default_rng(i).integers(1, 256, n)])
           for i, n in enumerate(LENGTHS)]
POOL = PrefillPoolConfig(devices=2, pages_per_device=8, rank_token_buckets=(32,))


# 15 full pages: a whole 16-page replica's reservation but one (and the 2-device pool's).
NEARLY_FULL = TokensPrompt([int(t) for t in np.random.default_rng(9).integers(1, 256, 245)])


@pytest.fixture(scope="module")
def replica_tokens():
    """The greedy tokens of PROMPTS and then NEARLY_FULL on one replica alone."""
    with Server(tiny_model(), engine_config=TINY_ENGINE, warmup=False,
                cache_dir=False) as server:
        return [out.token_ids for out in server.generate(PROMPTS + [NEARLY_FULL], GREEDY)]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # killed
def test_pool_prefills_then_a_replica_decodes_its_greedy_tokens(replica_tokens):
    """Each prompt with a full page and a token more is prefilled in the pool (its full
    pages, planned over the ring's groups) and one of two replicas takes those pages and
    computes the rest: the tokens of a replica serving alone, the pages counted as cached;
    a shorter prompt is served by a replica alone. A request whose pool step fails is
    prefilled by a replica instead, with the same tokens; one cancelled at once ends
    cancelled wherever it was. When the pool's thread dies, what it held and what comes
    after are served by the replicas. A request in flight when the server closes with
    drain=True finishes. Afterwards every page of the pool and the replicas is free."""
    with Server(tiny_model(), replicas=2, engine_config=TINY_ENGINE, warmup=False,
                cache_dir=False, prefill_pool=POOL) as server:
        pool = server.prefill_pool
        assert set(pool.models) == {1, 2}               # Eq. 1 fitted per group size
        # r per arrival rate, profiled on the fitted models when the pool started.
        assert set(pool.improvement.table.improvement_rates) <= \
            set(IMPROVEMENT_RATE_CANDIDATES)
        assert pool.warm_up_replicas() > 0              # what warmup=True compiles there
        placing = pool_handoff._by_position._cache_size()
        outs = server.generate(PROMPTS, GREEDY)
        assert pool_handoff._by_position._cache_size() == placing    # no compile
        assert [out.token_ids for out in outs] == replica_tokens[:len(PROMPTS)]
        through_pool = [n for n in LENGTHS if n > PAGE]
        assert pool.prefilled == len(through_pool)
        for n, out in zip(LENGTHS, outs):
            # Pages the pool computed: every full page but a last one without a token after.
            assert out.metrics.num_cached_tokens == ((n - 1) // PAGE * PAGE if n > PAGE else 0)

        # The pool keeps no array of a request it handed on: the second time, the live
        # arrays are the first time's (the K/V it gathered went with the requests).
        def live_arrays():
            assert wait_until_idle(server)
            gc.collect()
            return sorted((a.shape, a.dtype.name) for a in jax.live_arrays())
        before = live_arrays()
        assert [out.token_ids for out in server.generate(PROMPTS, GREEDY)] == \
            replica_tokens[:len(PROMPTS)]
        assert live_arrays() == before
        text = server.metrics_text()
        assert f"medha_prefill_pool_improvement_rate {pool.improvement.current}" in text
        assert f'medha_prefill_pool_requests_total{{outcome="prefilled"}} ' \
            f'{float(2 * len(through_pool))}' in text

        def broken(*args):
            raise RuntimeError("a failed step")
        pool.pool.dispatch_chunk = broken
        assert server.generate(PROMPTS[3], GREEDY).token_ids == replica_tokens[3]
        assert 'medha_prefill_pool_requests_total{outcome="replica"} 1.0' in \
            server.metrics_text()
        del pool.pool.dispatch_chunk
        assert pool.num_free_pages == pool.num_pages

        handle = server.submit(PROMPTS[-1], SamplingParams(temperature=0.0, max_tokens=50))
        assert handle.cancel()
        assert handle.result(timeout=60).finish_reason == "cancelled"
        assert wait_until_idle(server)
        assert pool.num_free_pages == pool.num_pages

        # The pool's thread dies: what it held is prefilled by a replica, and the requests
        # after it go to the replicas.
        def killed():
            raise SystemExit("the pool's thread is killed")
        pool._admit = killed
        assert server.generate(PROMPTS[2], GREEDY).token_ids == replica_tokens[2]
        pool.thread.join(30)
        assert not pool.thread.is_alive() and not pool.accepts(100, GREEDY)
        assert server.generate(PROMPTS[1], GREEDY).token_ids == replica_tokens[1]

        # Closing with drain: what the pool holds goes on to a replica and finishes there.
        handle = server.submit(PROMPTS[4], GREEDY)
        server.close(drain=True)
        assert handle.result(timeout=60).token_ids == replica_tokens[4]
    assert pool.num_free_pages == pool.num_pages
    assert server.num_free_pages == server.num_total_pages


def test_a_pool_needs_its_config_devices_to_spare_and_no_roles():
    with pytest.raises(ValueError, match="power of two"):
        PrefillPoolConfig(devices=3)
    with pytest.raises(TypeError, match="PrefillPoolConfig"):
        Server(tiny_model(), prefill_pool={"devices": 2}, warmup=False, cache_dir=False)
    with pytest.raises(ValueError, match="does not combine with roles"):
        Server(tiny_model(), replicas=2, roles="prefill:1,decode:1", prefill_pool=POOL,
               warmup=False, cache_dir=False)
    with pytest.raises(ValueError, match="needs 8 devices besides"):
        Server(tiny_model(), prefill_pool=PrefillPoolConfig(devices=8), warmup=False,
               cache_dir=False)


@pytest.mark.slow
def test_the_decode_replica_reserves_the_pages_before_the_pool_computes_them(replica_tokens):
    """The handshake: a decode replica without room for a request's full pages refuses
    it, and the request waits at the head of the pool's queue, not computed, until pages
    come back; then the replica reserves them, the pool computes them and that replica
    takes them. The tokens of a replica serving alone; every page back after."""
    engine = dataclasses.replace(TINY_ENGINE, max_kv_tokens=256)      # 16 pages
    with Server(tiny_model(), engine_config=engine, warmup=False, cache_dir=False,
                prefill_pool=dataclasses.replace(POOL, min_prompt_tokens=90)) as server:
        pool = server.prefill_pool
        refusals, reserved_on = [], []
        refused, dispatch = pool._refused, pool.pool.dispatch_chunk

        def count_refusal(rid, replica):
            refusals.append(replica)
            refused(rid, replica)

        def dispatch_chunk(rid, *args):
            reserved_on.append(pool._table[rid].decode)
            return dispatch(rid, *args)
        pool._refused, pool.pool.dispatch_chunk = count_refusal, dispatch_chunk
        # Under the pool's 90 tokens: the replica prefills it, and decoding fills its pages.
        filler = server.submit(TokensPrompt(list(range(1, 81))),
                               SamplingParams(temperature=0.0, max_tokens=160,
                                              ignore_eos=True))
        deadline = time.monotonic() + 60
        while server.num_free_pages > 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert server.num_free_pages <= 4                   # fewer than PROMPTS[4]'s 6
        out = server.generate(PROMPTS[4], GREEDY)
        assert out.token_ids == replica_tokens[4]
        assert refusals and set(reserved_on) == {0}          # computed once reserved
        assert f"medha_prefill_pool_refusals_total {float(len(refusals))}" in \
            server.metrics_text()
        assert out.metrics.num_cached_tokens == (100 - 1) // PAGE * PAGE
        assert len(filler.result(timeout=60).token_ids) == 160
        assert wait_until_idle(server)
        assert pool.num_free_pages == pool.num_pages


@pytest.mark.slow
def test_requests_behind_a_refused_head_give_their_reservations_back(replica_tokens):
    """A head refused by every replica waits, and the requests behind it, which asked
    ahead of their turn and may hold the very pages it needs, give theirs back: here a
    15-page head on a 16-page replica, refused while a chat runs, and a 2-page request
    granted behind it; once the chat ends only the 2 pages stand in its way. Both are
    served with a replica's tokens (no deadlock), every page back after."""
    engine = dataclasses.replace(TINY_ENGINE, max_kv_tokens=256)      # 16 pages
    with Server(tiny_model(), engine_config=engine, warmup=False, cache_dir=False,
                prefill_pool=dataclasses.replace(POOL, min_prompt_tokens=44)) as server:
        chat = server.submit(TokensPrompt(list(range(1, 41))),     # under 44: a replica's
                             SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
        deadline = time.monotonic() + 60
        while server.num_free_pages > 13 and time.monotonic() < deadline:
            time.sleep(0.002)
        assert server.num_free_pages <= 13                   # the head's 15 do not fit
        head, behind = server.submit(NEARLY_FULL, GREEDY), server.submit(PROMPTS[2], GREEDY)
        assert head.result(timeout=60).token_ids == replica_tokens[len(PROMPTS)]
        assert behind.result(timeout=60).token_ids == replica_tokens[2]
        assert len(chat.result(timeout=60).token_ids) == 100
        assert wait_until_idle(server)
        assert server.prefill_pool.prefilled == 2
        assert server.prefill_pool.num_free_pages == server.prefill_pool.num_pages


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # killed
def test_a_decode_replica_that_dies_holding_an_ask_is_passed_over(replica_tokens):
    """The freest replica is asked to reserve and dies before it answers (its loop drops
    the calls posted to it): the pool asks the other one, which serves the request with
    a lone replica's tokens; the pool's pages all come back."""
    import threading

    with Server(tiny_model(), replicas=2, engine_config=TINY_ENGINE, warmup=False,
                cache_dir=False, prefill_pool=POOL) as server:
        pool = server.prefill_pool
        held, release = threading.Event(), threading.Event()

        def die_when_released():
            held.set()
            release.wait(60)
            raise SystemExit("replica 0's loop is killed")
        assert pool.replicas[0].loop.call(die_when_released)
        assert held.wait(60)                    # replica 0's loop is inside the call
        handle = server.submit(PROMPTS[3], GREEDY)
        deadline = time.monotonic() + 60
        while not any(e.asked == 0 for e in list(pool._table.values())) and \
                time.monotonic() < deadline:
            time.sleep(0.002)
        release.set()                           # it dies with the ask in its inbox
        assert handle.result(timeout=60).token_ids == replica_tokens[3]
        assert not pool.replicas[0].loop.healthy and pool.prefilled == 1
        assert wait_until_idle(server)
        assert pool.num_free_pages == pool.num_pages


def test_the_start_up_profile_scales_its_arrival_rates_to_the_pool_and_picks_candidates():
    """The improvement-rate table is profiled at loads of the pool's throughput bound: a
    device twice as slow halves every arrival rate and keeps each rate's r (the same
    simulation in a slower clock); every r is a candidate; the profile is seeded."""
    def models(scale):
        return {s: LatencyModel(s, 0.01 * scale, 2e-5 * scale / s, 2e-10 * scale / s,
                                1e-10 * scale / s) for s in (1, 2, 4)}
    config = PrefillPoolConfig(devices=4).planner(16)
    fast = profile_improvement(CdspScheduler(4, models(1.0), config), smallest_prompt=17,
                               largest_prompt=4 * 64 * 16)
    slow = profile_improvement(CdspScheduler(4, models(2.0), config), smallest_prompt=17,
                               largest_prompt=4 * 64 * 16)
    assert len(fast.arrival_rates) == len(PROFILED_LOADS)
    assert np.allclose(np.array(fast.arrival_rates) / PROFILED_LOADS,
                       fast.arrival_rates[-1] / PROFILED_LOADS[-1])
    assert np.allclose(slow.arrival_rates, np.array(fast.arrival_rates) / 2)
    assert slow.improvement_rates == fast.improvement_rates      # the same pool, time x 2
    assert set(fast.improvement_rates) <= set(IMPROVEMENT_RATE_CANDIDATES)
    assert profile_improvement(CdspScheduler(4, models(1.0), config), smallest_prompt=17,
                               largest_prompt=4 * 64 * 16) == fast
    with pytest.raises(ValueError, match="improvement_rate"):
        PrefillPoolConfig(improvement_rate=1.5)


def test_decode_replicas_are_asked_freest_first():
    """Tetris's decode routing: free pages per running request, an idle replica first,
    ties to the lower index; a replica that is down is not asked."""
    from types import SimpleNamespace

    from serving.replicas import by_freeness

    def replica(free_pages, running, healthy=True):
        return SimpleNamespace(loop=SimpleNamespace(free_pages=free_pages, healthy=healthy,
                                                    load=(0, running, 0.0)))
    replicas = [replica(40, 4), replica(30, 1), replica(10, 0), replica(40, 4),
                replica(99, 0, healthy=False)]
    assert by_freeness(replicas, range(5)) == [2, 1, 0, 3]
    assert by_freeness(replicas, [0, 3]) == [0, 3]
