"""The router's exact prefix index against the allocators it follows."""

import random

import pytest

from medha_jax.cluster.prefix_index import CacheEvent, PrefixIndex
from medha_jax.kv_cache.allocator import BlockAllocator, prefix_page_hashes
from medha_jax.request import VirtualClock


def test_cached_pages_counts_each_replicas_leading_pages_in_one_walk():
    index = PrefixIndex(3)
    a, b, c, d = (bytes([i]) * 16 for i in range(4))
    index.apply(CacheEvent(0, 0, stored=(a, b, c)))
    index.apply(CacheEvent(1, 0, stored=(a, c)))          # holds c but not b: prefix stops at a
    index.apply(CacheEvent(2, 0, stored=(b,)))            # b without a is no prefix
    assert index.cached_pages([a, b, c, d]) == [3, 1, 0]
    assert index.cached_pages([]) == [0, 0, 0]
    index.apply(CacheEvent(0, 1, removed=(b,)))
    assert index.cached_pages([a, b, c]) == [1, 1, 0]
    index.apply(CacheEvent(0, 2, cleared=True, stored=(d,)))
    assert index.cached_pages([a]) == [0, 1, 0] and index.cached_pages([d]) == [1, 0, 0]


def test_a_lost_event_drops_the_replicas_entries_until_it_resends():
    index = PrefixIndex(2)
    a, b = b"a" * 16, b"b" * 16
    assert index.apply(CacheEvent(0, 0, stored=(a,)))
    assert index.apply(CacheEvent(1, 0, stored=(a,)))
    # Event 1 of replica 0 was lost: what the index held of replica 0 may be stale.
    assert not index.apply(CacheEvent(0, 2, stored=(b,)))
    assert index.num_gaps == 1
    assert index.cached_pages([a]) == [0, 1]
    assert index.cached_pages([b]) == [1, 0]
    assert index.apply(CacheEvent(0, 3, stored=(a,)))     # numbering goes on from the gap


def test_speculative_marks_hold_until_they_expire():
    clock = VirtualClock()
    index = PrefixIndex(2, speculative_ttl_s=2.0, clock=clock.now)
    hashes = [bytes([i]) * 16 for i in range(4)]
    index.mark_routed(1, hashes[:3])
    assert index.cached_pages(hashes) == [0, 3]
    clock.advance_to(1.0)
    index.mark_routed(1, hashes[:1])                     # a later mark of page 0 outlives the first
    clock.advance_to(2.5)
    assert index.cached_pages(hashes) == [0, 1]
    clock.advance_to(3.5)
    assert index.cached_pages(hashes) == [0, 0]


def test_forget_replica_drops_confirmed_and_speculative_pages():
    index = PrefixIndex(2)
    a = b"a" * 16
    index.apply(CacheEvent(0, 0, stored=(a,)))
    index.mark_routed(0, [a])
    index.apply(CacheEvent(1, 0, stored=(a,)))
    index.forget_replica(0)
    assert index.cached_pages([a]) == [0, 1]


def test_bad_replica_numbers_are_refused():
    index = PrefixIndex(2)
    with pytest.raises(ValueError, match="replica 2"):
        index.apply(CacheEvent(2, 0))
    with pytest.raises(ValueError, match="num_replicas"):
        PrefixIndex(0)


def test_the_index_agrees_with_what_each_allocator_would_reuse():
    """Random prompts sharing prefixes, committed, freed and evicted on two allocators fed
    into one index: for every probe, the index's cached pages on a replica equal the pages
    that replica's allocator hands over (allocate's reuse, before its at-least-one-token
    rule), and every pool returns to full."""
    rng = random.Random(0)
    page_size = 4
    index = PrefixIndex(2, speculative_ttl_s=0)
    allocators = [BlockAllocator(12, page_size, on_cache_change=index.listener(r))
                  for r in range(2)]
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]

    def prompt():
        return rng.choice(stems)[:rng.randrange(0, 12)] + [rng.randrange(50)
                                                            for _ in range(rng.randrange(1, 9))]

    for step in range(200):
        r = rng.randrange(2)
        alloc, tokens = allocators[r], prompt()
        rid = f"req-{step}"
        # allocate() computes at least the last token: with one more, every full page of
        # `tokens` may be reused.
        hashes = prefix_page_hashes(tokens, page_size)
        expected = index.cached_pages(hashes)[r]
        reused = alloc.allocate(rid, tokens + [0])
        assert reused == expected * page_size, (step, reused, expected)
        if alloc.reserve(rid, len(tokens)):
            alloc.commit(rid, tokens, len(tokens))
        alloc.free(rid)
    for r, alloc in enumerate(allocators):
        assert alloc.num_free_pages == alloc.num_pages
        assert index.num_pages_held(r) == alloc.num_cached_pages > 0
    allocators[0].drop_prefix_cache()
    assert index.num_pages_held(0) == 0 and index.num_pages_held(1) == allocators[1].num_cached_pages


def test_prefix_page_hashes_are_the_allocators_hashes():
    alloc = BlockAllocator(8, 4)
    tokens = list(range(10))
    alloc.allocate("a", tokens)
    alloc.reserve("a", 10)
    alloc.commit("a", tokens, 10)
    alloc.free("a")
    hashes = prefix_page_hashes(tokens, 4)
    assert len(hashes) == 2
    assert alloc.allocate("b", tokens[:9]) == 8       # both full pages reused under those hashes


def test_marks_and_events_in_any_order_give_the_page_by_page_union():
    """Random marks, confirmations (in and out of page order), evictions and expiries on
    three replicas: every lookup equals a naive per-page walk over each replica's
    confirmed pages and the pages of its live marks from their first unconfirmed one."""
    rng = random.Random(1)
    clock = VirtualClock()
    index = PrefixIndex(3, speculative_ttl_s=2.0, clock=clock.now)
    stems = [prefix_page_hashes([rng.randrange(9) for _ in range(40)], 4) for _ in range(3)]
    confirmed = [set(), set(), set()]
    marks = []                                        # [replica, hashes, start, expiry]
    seq = [0, 0, 0]

    def naive(hashes):
        out = []
        for r in range(3):
            held = set(confirmed[r])
            for m in marks:
                if m[0] == r and m[3] > clock.now():
                    held.update(m[1][m[2]:])
            depth = 0
            while depth < len(hashes) and hashes[depth] in held:
                depth += 1
            out.append(depth)
        return out

    def event(r, stored=(), removed=()):
        index.apply(CacheEvent(r, seq[r], stored=tuple(stored), removed=tuple(removed)))
        seq[r] += 1
        confirmed[r].difference_update(removed)
        confirmed[r].update(stored)
        for m in marks:                              # a mark starts at its first unconfirmed page
            if m[0] == r:
                while m[2] < len(m[1]) and m[1][m[2]] in confirmed[r]:
                    m[2] += 1

    for step in range(600):
        stem = rng.choice(stems)
        prompt = stem[:rng.randrange(1, len(stem) + 1)]
        op = rng.random()
        if op < 0.3:
            r = rng.randrange(3)
            depth = index.cached_pages(prompt)[r]
            index.mark_routed(r, prompt[depth:])
            if depth < len(prompt):
                marks.append([r, tuple(prompt[depth:]), 0, clock.now() + 2.0])
                event(r)                             # no-op event: re-derive starts
        elif op < 0.55:
            r, k = rng.randrange(3), rng.randrange(len(prompt))
            pages = prompt[k:k + rng.randrange(1, 4)]
            event(r, stored=pages if rng.random() < 0.7 else pages[::-1])
        elif op < 0.7 and any(confirmed):
            r = rng.choice([r for r in range(3) if confirmed[r]])
            event(r, removed=rng.sample(sorted(confirmed[r]), 1))
        else:
            clock.advance(rng.random() * 0.5)
        assert index.cached_pages(prompt) == naive(prompt), step
