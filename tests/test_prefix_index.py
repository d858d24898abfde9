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


class _CountingDict(dict):
    """A dict that counts its get() calls: the pages a lookup reads."""

    reads = 0

    def get(self, key, default=None):
        self.reads += 1
        return super().get(key, default)


def test_a_lookup_reads_log_pages_per_replica_when_orphans_are_named():
    """Four replicas holding 0, 300, 700 and 1024 leading pages of a 1024-page prompt, their
    events naming their orphans (none): the lookup bisects (a dozen reads per replica that
    drops out), where withholding the orphans makes it read every page."""
    hashes = prefix_page_hashes(list(range(4096)), 4)
    for orphans, most_reads in (((), 4 * 12), (None, None)):
        index = PrefixIndex(4)
        for r, depth in enumerate((0, 300, 700, 1024)):
            index.apply(CacheEvent(r, 0, stored=tuple(hashes[:depth]), orphaned=orphans))
        index._confirmed = _CountingDict(index._confirmed)
        assert index.cached_pages(hashes) == [0, 300, 700, 1024]
        if most_reads is None:
            assert index._confirmed.reads >= 1024
        else:
            assert index._confirmed.reads <= most_reads


@pytest.mark.parametrize("evicted_before_commit", [False, True])
def test_a_page_computed_twice_leaves_an_orphan_the_lookup_does_not_skip_over(
        evicted_before_commit):
    """Two requests compute one prompt at once; the first registers it, the second's
    copies stay unregistered but its own later pages register under them. Evicting the
    first request's pages (before or after the second commits its later pages) leaves
    those without their parent (orphans): the allocator names them, no request can reuse
    them, and the index counts 0 leading pages there instead of bisecting onto them."""
    index = PrefixIndex(1, speculative_ttl_s=0)
    alloc = BlockAllocator(32, 2, on_cache_change=index.listener(0))
    shared = list(range(8))                          # 4 pages
    longer = shared + list(range(100, 140))          # 24 pages
    alloc.allocate("a", shared + [0])
    alloc.allocate("b", longer + [0])
    assert alloc.reserve("a", 8) and alloc.reserve("b", 48)
    alloc.commit("a", shared, 8)
    alloc.free("a")                                  # a's 4 pages cached, evictable
    alloc.commit("b", longer, 8)                     # b's first 4 pages are copies
    hashes = prefix_page_hashes(longer, 2)
    if not evicted_before_commit:
        alloc.commit("b", longer, 48)
        assert alloc.orphan_hashes == () and index.cached_pages(hashes) == [24]
    alloc.allocate("c", [7] * 16)
    assert alloc.reserve("c", 16)                    # 4 free pages, then a's 4 cached
    alloc.commit("b", longer, 48)
    assert alloc.orphan_hashes == (hashes[4],)
    assert alloc.allocate("d", longer + [0]) == 0
    assert index.cached_pages(hashes) == [0]
    alloc.free("d")
    alloc.free("c")
    # Recomputing the shared prompt registers its pages again: b's pages are whole again.
    alloc.allocate("e", shared + [0])
    assert alloc.reserve("e", 8)
    alloc.commit("e", shared, 8)
    assert alloc.orphan_hashes == () and index.cached_pages(hashes) == [24]


def _orphans(held: set, parent: dict) -> set:
    return {h for h in held if parent[h] is not None and parent[h] not in held}


def test_bisection_equals_the_page_by_page_walk_with_holes_marks_and_gaps():
    """Random holdings with holes (kvp-like: any page of a chain, any order), evictions,
    restatements, lost events, a replica that does not name its orphans, and speculative
    marks: every lookup equals a naive per-page walk over each replica's confirmed pages and
    its live marks' pages."""
    rng = random.Random(3)
    clock = VirtualClock()
    num = 4
    index = PrefixIndex(num, speculative_ttl_s=2.0, clock=clock.now)
    stems = [prefix_page_hashes([rng.randrange(5) for _ in range(120)], 4) for _ in range(4)]
    parent = {}
    for stem in stems:
        for k, h in enumerate(stem):
            parent[h] = stem[k - 1] if k else None
    held = [set() for _ in range(num)]
    marks = []                                        # [replica, hashes, start, expiry]
    seq = [0] * num
    names_orphans = [True, True, True, False]         # replica 3 never names them
    known = [True] * num                              # the index knows r's orphans

    def naive(hashes):
        out = []
        for r in range(num):
            pages = set(held[r])
            for m in marks:
                if m[0] == r and m[3] > clock.now():
                    pages.update(m[1][m[2]:])
            depth = 0
            while depth < len(hashes) and hashes[depth] in pages:
                depth += 1
            out.append(depth)
        return out

    def event(r, stored=(), removed=(), cleared=False, lose=False):
        before = _orphans(held[r], parent)
        if cleared:
            held[r].clear()
        held[r].difference_update(removed)
        held[r].update(stored)
        after = _orphans(held[r], parent)
        seq[r] += 1 + lose
        if names_orphans[r]:
            orphaned = tuple(after) if cleared else tuple(after - before)
            adopted = () if cleared else tuple((before - after) & held[r])
        else:
            orphaned, adopted = None, ()
        index.apply(CacheEvent(r, seq[r] - 1, tuple(stored), tuple(removed), cleared,
                               orphaned, adopted))
        if lose:                                      # the index forgets r's marks too
            marks[:] = [m for m in marks if m[0] != r]
        known[r] = names_orphans[r] and (cleared or known[r] and not lose)
        for m in marks:                              # a mark starts at its first unconfirmed page
            if m[0] == r:
                while m[2] < len(m[1]) and m[1][m[2]] in held[r]:
                    m[2] += 1

    for step in range(1500):
        stem = rng.choice(stems)
        prompt = stem[:rng.randrange(1, len(stem) + 1)]
        r = rng.randrange(num)
        op = rng.random()
        if op < 0.15:
            depth = index.cached_pages(prompt)[r]
            index.mark_routed(r, prompt[depth:])
            marks.append([r, tuple(prompt[depth:]), 0, clock.now() + 2.0])
        elif op < 0.45:                                # a run of pages, or a prefix
            k = rng.randrange(len(prompt)) if rng.random() < 0.5 else 0
            pages = prompt[k:k + rng.randrange(1, 30)]
            event(r, stored=pages if rng.random() < 0.7 else pages[::-1])
        elif op < 0.7 and held[r]:
            event(r, removed=rng.sample(sorted(held[r]), min(len(held[r]), rng.randrange(1, 4))))
        elif op < 0.72:                                # restates its cache
            event(r, stored=tuple(held[r]), cleared=True)
        elif op < 0.74:                                # an event is lost: the index drops r
            pages = prompt[:rng.randrange(len(prompt))]
            held[r] = set()                            # and rebuilds r from this event
            event(r, stored=pages, lose=True)
        else:
            clock.advance(rng.random() * 0.3)
        assert index.cached_pages(prompt) == naive(prompt), step
        # Where the index knows a replica's orphans it bisects: they must be exact there
        # (a stale one costs a walk, a missing one a wrong count).
        assert index._orphans_known == sum(1 << r for r in range(num) if known[r])
        for r in range(num):
            if known[r]:
                assert {h for h, mask in index._orphans.items() if mask >> r & 1} == \
                    _orphans(held[r], parent), step


def test_the_allocators_name_their_orphans_with_kv_shards_and_twice_computed_pages():
    """Two allocators of two KV shards each (every shard evicts on its own, so a prompt's
    pages there have holes), with overlapping requests that compute the same prefixes at
    once and commit in chunks, the second one followed only from step 700 on
    (restate_cache): after every operation each followed allocator's orphans are its
    registered pages whose parent is not, the index knows them, and its lookups equal a
    page-by-page walk over what each followed allocator has registered."""
    rng = random.Random(5)
    page_size = 2
    index = PrefixIndex(2, speculative_ttl_s=0)
    allocators = [BlockAllocator(10, page_size, num_shards=2, max_tokens_per_shard=8,
                                 on_cache_change=index.listener(0)),
                  BlockAllocator(10, page_size, num_shards=2, max_tokens_per_shard=8)]
    stems = [[rng.randrange(3) for _ in range(16)] for _ in range(3)]
    parent = {}
    for stem in stems:
        chain = prefix_page_hashes(stem, page_size)
        parent.update((h, chain[k - 1] if k else None) for k, h in enumerate(chain))
    live = [{} for _ in range(2)]                     # request id -> (tokens, computed)
    saw_orphans = 0
    for step in range(1500):
        if step == 700:
            assert allocators[1].orphan_hashes is None
            allocators[1].on_cache_change = index.listener(1)
            allocators[1].restate_cache()
        r = rng.randrange(2)
        alloc, requests = allocators[r], live[r]
        op = rng.random()
        if op < 0.4 and len(requests) < 3:
            tokens = rng.choice(stems)[:rng.randrange(2, 17)]
            rid = f"req-{step}"
            alloc.allocate(rid, tokens)
            if alloc.reserve(rid, len(tokens)):
                requests[rid] = (tokens, 0)
            else:
                alloc.free(rid)
        elif op < 0.75 and requests:
            rid = rng.choice(sorted(requests))
            tokens, computed = requests[rid]
            computed = min(len(tokens), computed + rng.randrange(1, 9))
            alloc.commit(rid, tokens, computed)
            requests[rid] = (tokens, computed)
        elif requests:
            rid = rng.choice(sorted(requests))
            del requests[rid]
            alloc.free(rid)
        registered = [set(a._page_of_hash) if a.on_cache_change else set()
                      for a in allocators]
        assert index._orphans_known == 0b11
        for i, (a, held) in enumerate(zip(allocators, registered)):
            if not a.on_cache_change:
                continue
            assert set(a.orphan_hashes) == _orphans(held, parent), step
            assert {h for h, mask in index._orphans.items() if mask >> i & 1} == \
                set(a.orphan_hashes), step
            saw_orphans += bool(a.orphan_hashes)
        probe = prefix_page_hashes(rng.choice(stems), page_size)
        expected = []
        for held in registered:
            depth = 0
            while depth < len(probe) and probe[depth] in held:
                depth += 1
            expected.append(depth)
        assert index.cached_pages(probe) == expected, step
    assert saw_orphans > 50                            # the holes did happen
