"""BlockAllocator over KV-parallel shards: segment placement, prefix reuse across shards,
per-shard eviction, slot_of, and a random workload that checks every invariant each step."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from medha_jax.kv_cache import BlockAllocator, Segment


def _layout(alloc, request_id):
    """[(shard, first_token, local page ids)] of a request's segments."""
    return [(s.shard, s.first_token, s.table.tolist()) for s in alloc.segments(request_id)]


def test_request_longer_than_one_pool_spans_shards_progressively():
    # One pool: 8 pages x 4 tokens = 32 tokens.
    one = BlockAllocator(8, 4)
    assert not one.can_ever_fit(100)
    one.allocate("long")
    with pytest.raises(ValueError, match=r"num_tokens=100 needs 25 pages .* num_shards=1"):
        one.reserve("long", 100)

    alloc = BlockAllocator(8, 4, num_shards=4)
    assert alloc.num_pages == 32 and alloc.pages_per_shard == 8 and alloc.num_shards == 4
    assert alloc.can_ever_fit(100) and alloc.can_ever_fit(128) and not alloc.can_ever_fit(129)
    alloc.allocate("long")
    assert alloc.reserve("long", 10)                    # one shard while the context is short
    assert [s.shard for s in alloc.segments("long")] == [0]
    assert alloc.reserve("long", 40)
    assert [(s.shard, s.first_token) for s in alloc.segments("long")] == [(0, 0), (1, 32)]
    assert alloc.reserve("long", 100)
    assert [(shard, first, len(t)) for shard, first, t in _layout(alloc, "long")] == [
        (0, 0, 8), (1, 32, 8), (2, 64, 8), (3, 96, 1)]
    assert [alloc.num_free_pages_on(s) for s in range(4)] == [0, 0, 0, 7]
    # Reserved capacity: pages_needed(n) * page_size tokens, as the controller assumes.
    assert sum(len(s.table) for s in alloc.segments("long")) == alloc.pages_needed(100)
    alloc.free("long")
    assert [alloc.num_free_pages_on(s) for s in range(4)] == [8] * 4


def test_short_requests_spread_over_shards_by_load():
    alloc = BlockAllocator(8, 4, num_shards=4)
    for i in range(4):
        alloc.allocate(f"r{i}")
        assert alloc.reserve(f"r{i}", 5)                # 2 pages each
    assert [alloc.segments(f"r{i}")[0].shard for i in range(4)] == [0, 1, 2, 3]
    alloc.allocate("r4")
    assert alloc.reserve("r4", 12)                      # all loaded 2: lowest id
    alloc.allocate("r5")
    assert alloc.reserve("r5", 4)                       # shard 0 now has 5 used
    assert alloc.segments("r4")[0].shard == 0 and alloc.segments("r5")[0].shard == 1
    assert [alloc.num_used_pages_on(s) for s in range(4)] == [5, 3, 2, 2]
    alloc.free("r1")
    alloc.allocate("r6")
    assert alloc.reserve("r6", 4)
    assert alloc.segments("r6")[0].shard == 1          # used 1 < 2


def test_prefix_reused_across_two_shards_follows_the_cached_pages():
    # 2 pages per segment, 3 shards of 4 pages.
    alloc = BlockAllocator(4, 4, num_shards=3, max_tokens_per_shard=8)
    prompt = list(range(100, 120))                      # 20 tokens: 5 full pages
    assert alloc.allocate("a", prompt) == 0
    assert alloc.reserve("a", 20)
    alloc.commit("a", prompt, 20)
    layout_a = _layout(alloc, "a")
    assert [(shard, first) for shard, first, _ in layout_a] == [(0, 0), (1, 8), (2, 16)]
    alloc.free("a")
    assert alloc.num_cached_pages == 5
    for rid, n, shard in (("x", 8, 2), ("y", 4, 0)):   # fresh pages go where least is cached
        alloc.allocate(rid)
        assert alloc.reserve(rid, n) and alloc.segments(rid)[0].shard == shard
    assert [alloc.num_used_pages_on(s) for s in range(3)] == [1, 0, 2]
    # The first cached page decides segment 0's shard, load or not.
    assert alloc.allocate("b", prompt + [7, 7, 7]) == 20
    assert _layout(alloc, "b") == layout_a
    assert alloc.reserve("b", 23)                       # the last segment grows on its shard
    assert _layout(alloc, "b")[2][0] == 2 and len(_layout(alloc, "b")[2][2]) == 2
    assert alloc.num_used_pages == 2 + 1 + 6
    # Sharing across shards is by reference: a second reader takes the same pages.
    assert alloc.allocate("c", prompt) == 16
    assert _layout(alloc, "c") == [(0, 0, layout_a[0][2]), (1, 8, layout_a[1][2])]


def test_prefix_reuse_stops_where_the_next_segment_would_share_a_shard():
    alloc = BlockAllocator(4, 4, num_shards=2, max_tokens_per_shard=8)
    prompt = list(range(15))
    # a and b compute the same prefix at the same time: a's segment 0 lands on shard 0,
    # b's on shard 1, so b's segment 1 (the page at token 8) lands on shard 0.
    for rid, n in (("a", 8), ("b", 12)):
        assert alloc.allocate(rid, prompt) == 0
        assert alloc.reserve(rid, n)
    assert [s.shard for s in alloc.segments("b")] == [1, 0]
    alloc.commit("a", prompt, 8)                        # pages 0-1 on shard 0
    alloc.commit("b", prompt, 12)                       # only page 2 is new: shard 0
    assert alloc.num_cached_pages == 3
    # c starts on shard 0 (a's pages); the cached page for token 8 is also on shard 0,
    # which c's segment 0 already uses, so reuse stops at the segment boundary.
    assert alloc.allocate("c", prompt) == 8
    assert [(s.shard, s.first_token) for s in alloc.segments("c")] == [(0, 0)]
    assert alloc.reserve("c", 15)
    assert [(s.shard, s.first_token) for s in alloc.segments("c")] == [(0, 0), (1, 8)]


def test_prefix_reuse_stops_at_a_cached_page_on_another_shard_inside_a_segment():
    alloc = BlockAllocator(4, 4, num_shards=2, max_tokens_per_shard=8)
    prompt = list(range(12))
    # Computed concurrently: a registers page 0 (shard 0), b registers page 1 (shard 1).
    for rid, n in (("a", 4), ("b", 8)):
        assert alloc.allocate(rid, prompt) == 0
        assert alloc.reserve(rid, n)
    alloc.commit("a", prompt, 4)
    alloc.commit("b", prompt, 8)
    assert [alloc.segments(r)[0].shard for r in "ab"] == [0, 1]
    # Page 1 belongs in segment 0 (shard 0) but is cached on shard 1: not reusable.
    assert alloc.allocate("c", prompt) == 4
    assert _layout(alloc, "c") == [(0, 0, alloc.segments("a")[0].table.tolist())]


def test_eviction_is_per_shard_and_avoids_cached_pages_on_ties():
    alloc = BlockAllocator(2, 4, num_shards=2)
    prompt_a, prompt_b = [1] * 9, [2] * 9
    for rid, prompt in (("a", prompt_a), ("b", prompt_b)):
        alloc.allocate(rid, prompt)
        assert alloc.reserve(rid, 8)
        alloc.commit(rid, prompt, 8)
    # b went to shard 1 because a was using shard 0.
    assert [alloc.segments(r)[0].shard for r in ("a", "b")] == [0, 1]
    alloc.free("a")
    alloc.allocate("c")
    assert alloc.reserve("c", 4)    # shard 0: nothing used there, even though it must evict
    assert alloc.segments("c")[0].shard == 0
    assert alloc.num_cached_pages == 3                  # a's deepest page went first
    alloc.free("b")
    assert alloc.allocate("again-a", prompt_a) == 4     # a's first page is still cached
    assert alloc.allocate("again-b", prompt_b) == 8     # shard 1's cache was not touched
    assert [alloc.segments(r)[0].shard for r in ("again-a", "again-b")] == [0, 1]


def test_equally_loaded_shards_prefer_the_one_with_nothing_to_evict():
    alloc = BlockAllocator(2, 4, num_shards=2)
    prompt = [3] * 9
    alloc.allocate("a", prompt)
    assert alloc.reserve("a", 8)
    alloc.commit("a", prompt, 8)
    alloc.free("a")                                     # shard 0: 2 cached pages, 0 used
    alloc.allocate("b")
    assert alloc.reserve("b", 8)
    assert alloc.segments("b")[0].shard == 1 and alloc.num_cached_pages == 2


def test_reserve_across_shards_is_all_or_nothing():
    alloc = BlockAllocator(4, 4, num_shards=2, max_tokens_per_shard=8)
    for rid, n in (("a", 4), ("b", 8), ("c", 8), ("d", 8)):
        alloc.allocate(rid)
        assert alloc.reserve(rid, n)
    assert [alloc.segments(r)[0].shard for r in "abcd"] == [0, 1, 0, 1]
    before = (_layout(alloc, "a"), alloc.num_free_pages_on(0), alloc.num_free_pages_on(1))
    # Segment 0 could grow on shard 0 (1 free page) but segment 1 finds shard 1 full.
    assert not alloc.reserve("a", 12)
    assert (_layout(alloc, "a"), alloc.num_free_pages_on(0), alloc.num_free_pages_on(1)) == before
    alloc.free("d")
    assert alloc.reserve("a", 12)
    assert [(s.shard, len(s.table)) for s in alloc.segments("a")] == [(0, 2), (1, 1)]


def test_shards_short_names_where_a_failed_reserve_lacks_pages():
    """Where freeing pages can make a failed reserve succeed: the last segment's own shard
    to grow it; for a new segment, the shards the request does not use yet that lack room
    for it. Freeing pages anywhere else changes nothing."""
    # Growing the last segment: only its shard counts, however empty the others are.
    alloc = BlockAllocator(2, 4, num_shards=2)
    for rid in "xyz":
        alloc.allocate(rid)
        assert alloc.reserve(rid, 4)
    assert [alloc.shards_of(r) for r in "xyz"] == [(0,), (1,), (0,)]
    assert alloc.shards_short("x", 4) == frozenset()            # holds it already
    assert alloc.shards_short("x", 8) == frozenset({0})
    alloc.free("y")                                             # shard 1 empties: no help
    assert alloc.shards_short("x", 8) == frozenset({0}) and not alloc.reserve("x", 8)
    alloc.free("z")
    assert alloc.shards_short("x", 8) == frozenset() and alloc.reserve("x", 8)
    assert alloc.shards_short("x", 100) == frozenset()          # can never fit: reserve raises
    with pytest.raises(ValueError, match="unknown request 'nobody'"):
        alloc.shards_short("nobody", 4)

    # A new segment: the unused shards without room for it.
    alloc = BlockAllocator(4, 4, num_shards=3, max_tokens_per_shard=8)   # 2-page segments
    for rid, n in (("e", 8), ("g", 16), ("h", 8), ("i", 4), ("j", 4)):
        alloc.allocate(rid)
        assert alloc.reserve(rid, n)
    assert [alloc.shards_of(r) for r in "eghij"] == [(0,), (1, 2), (0,), (1,), (2,)]
    assert [alloc.num_free_pages_on(s) for s in range(3)] == [0, 1, 1]
    assert alloc.shards_short("e", 12) == frozenset()           # a 1-page segment fits
    assert alloc.shards_short("e", 16) == frozenset({1, 2})     # a 2-page one does not
    alloc.free("h")                                             # e's own full shard: no help
    assert alloc.shards_short("e", 16) == frozenset({1, 2}) and not alloc.reserve("e", 16)
    alloc.free("i")
    assert alloc.shards_short("e", 16) == frozenset() and alloc.reserve("e", 16)
    assert alloc.shards_of("e") == (0, 1)
    # A request without pages: any shard, except those with room for a whole segment.
    assert [alloc.num_free_pages_on(s) for s in range(3)] == [2, 0, 1]
    alloc.allocate("f")
    assert alloc.shards_of("f") == () and alloc.shards_short("f", 8) == frozenset()
    assert alloc.shards_short("f", 16) == frozenset({1, 2})


def test_slot_of_agrees_with_segments():
    alloc = BlockAllocator(6, 4, num_shards=3, max_tokens_per_shard=12)
    alloc.allocate("other")
    assert alloc.reserve("other", 5)                    # local ids differ between shards
    alloc.allocate("a")
    assert alloc.reserve("a", 30)
    positions = np.random.default_rng(0).permutation(32)    # all 8 reserved pages
    shards, slots = alloc.slot_of("a", positions)
    assert shards.dtype == np.int32 and slots.dtype == np.int32
    expected = {}
    for seg in alloc.segments("a"):
        for i, page in enumerate(seg.table.tolist()):
            for offset in range(4):
                expected[seg.first_token + 4 * i + offset] = (seg.shard, page * 4 + offset)
    assert sorted(expected) == list(range(32))
    assert list(zip(shards.tolist(), slots.tolist())) == [expected[p] for p in positions]
    assert len(set(zip(shards.tolist(), slots.tolist()))) == 32
    empty = alloc.slot_of("a", np.zeros(0, np.int64))
    assert empty[0].shape == empty[1].shape == (0,)
    with pytest.raises(ValueError, match=r"'a': positions in \[0, 32\] outside the 32 reserved"):
        alloc.slot_of("a", np.array([0, 32]))
    with pytest.raises(ValueError, match=r"positions in \[-1, 3\]"):
        alloc.slot_of("a", np.array([-1, 3]))
    with pytest.raises(ValueError, match="1-D"):
        alloc.slot_of("a", np.zeros((2, 2), np.int64))


def test_segments_are_read_only_and_one_shard_keeps_page_tables():
    one = BlockAllocator(8, 4)
    one.allocate("a")
    assert one.reserve("a", 10)
    (seg,) = one.segments("a")
    assert seg == Segment(0, 0, seg.table) and seg.table.tolist() == one.page_table("a")
    with pytest.raises(ValueError):
        seg.table[0] = 5
    many = BlockAllocator(8, 4, num_shards=2)
    many.allocate("a")
    assert many.reserve("a", 10)
    for call in (many.page_table, many.page_table_array):
        with pytest.raises(ValueError, match="only defined for num_shards=1.*num_shards=2"):
            call("a")
    with pytest.raises(ValueError, match=r"shard=2 must be in \[0, num_shards=2\)"):
        many.num_free_pages_on(2)


def test_num_pages_keyword_is_the_total():
    alloc = BlockAllocator(num_pages=8, page_size=4, num_shards=2)
    assert alloc.pages_per_shard == 4 and alloc.num_pages == 8
    assert alloc.max_tokens_per_shard == 16 and alloc.max_tokens_per_request == 32
    assert alloc.num_free_pages == 8 and alloc.num_free_pages_on(1) == 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(pages_per_shard=4, page_size=4, num_shards=0), "num_shards must be an int >= 1, got 0"),
    (dict(pages_per_shard=4, page_size=4, max_tokens_per_shard=6),
     "max_tokens_per_shard=6 must be a multiple of page_size=4"),
    (dict(pages_per_shard=4, page_size=4, max_tokens_per_shard=0), "max_tokens_per_shard"),
    (dict(pages_per_shard=4, page_size=4, max_tokens_per_shard=20),
     "max_tokens_per_shard=20 exceeds .* = 16 tokens"),
    (dict(num_pages=10, page_size=4, num_shards=4), "num_pages=10 .* num_shards=4"),
    (dict(pages_per_shard=4, num_pages=8, page_size=4), "not both"),
    (dict(page_size=4), "pages_per_shard must be an int >= 1, got None"),
])
def test_constructor_validates_shards(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockAllocator(**kwargs)


class ShardedWorkload(RuleBasedStateMachine):
    """Random allocate / compute / fork-by-prefix / free over 3 shards of 4 pages.

    A model KV cache, keyed by (shard, local page), records for every slot written the whole
    token prefix it was computed from: a reused page must hold the new request's own prefix,
    and a shared or cached page must never be written. After every step: refcounts match the
    live segments, every page of every shard is in exactly one of used/cached/free, a
    request's segments are on distinct shards and cover contiguous token ranges, new
    segments went to the least loaded shard, and slot_of agrees with segments.
    """

    PAGE_SIZE = 2
    PAGES_PER_SHARD = 4
    NUM_SHARDS = 3
    SEGMENT_TOKENS = 4                                  # 2 pages per segment, 12 tokens max

    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(self.PAGES_PER_SHARD, self.PAGE_SIZE,
                                    num_shards=self.NUM_SHARDS,
                                    max_tokens_per_shard=self.SEGMENT_TOKENS)
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.history: list[list[int]] = []
        self.kv: dict[tuple[int, int], list[tuple | None]] = {}
        self.next_id = 0

    def _pages(self, rid):
        """[(shard, local page)] of a request, in token order."""
        return [(seg.shard, page) for seg in self.alloc.segments(rid)
                for page in seg.table.tolist()]

    def _admit(self, tokens):
        rid = f"r{self.next_id}"
        self.next_id += 1
        reused = self.alloc.allocate(rid, tokens)
        ps = self.PAGE_SIZE
        assert reused % ps == 0 and 0 <= reused < len(tokens)
        pages = self._pages(rid)
        assert len(pages) == reused // ps
        for pos in range(reused):
            assert self.kv[pages[pos // ps]][pos % ps] == tuple(tokens[:pos + 1])
        self.tokens[rid], self.computed[rid] = tokens, reused

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=12))
    def new_request(self, tokens):
        self._admit(tokens)

    @precondition(lambda self: self.history)
    @rule(pick=st.integers(0, 10**6), keep=st.floats(0, 1),
          suffix=st.lists(st.integers(0, 1), min_size=1, max_size=6))
    def fork_by_prefix(self, pick, keep, suffix):
        source = self.history[pick % len(self.history)]
        self._admit((source[:int(keep * len(source))] + suffix)[:12])

    def _pending(self):
        return [rid for rid in self.tokens if self.computed[rid] < len(self.tokens[rid])]

    @precondition(lambda self: self._pending())
    @rule(pick=st.integers(0, 10**6), n=st.integers(1, 8))
    def compute(self, pick, n):
        alloc, ps = self.alloc, self.PAGE_SIZE
        pending = self._pending()
        rid = pending[pick % len(pending)]
        tokens, start = self.tokens[rid], self.computed[rid]
        end = min(len(tokens), start + n)
        loads = [alloc.num_used_pages_on(s) for s in range(self.NUM_SHARDS)]
        free = [alloc.num_free_pages_on(s) for s in range(self.NUM_SHARDS)]
        old_shards = [seg.shard for seg in alloc.segments(rid)]
        before = (self._pages(rid), free)
        short = alloc.shards_short(rid, end)
        if not alloc.reserve(rid, end):
            assert short and short <= set(range(self.NUM_SHARDS)) - set(old_shards[:-1])
            assert (self._pages(rid), [alloc.num_free_pages_on(s)
                                       for s in range(self.NUM_SHARDS)]) == before
            return
        assert short == frozenset()
        new_shards = [seg.shard for seg in alloc.segments(rid)]
        assert new_shards[:len(old_shards)] == old_shards
        assert alloc.shards_of(rid) == tuple(new_shards)
        used = set(old_shards)
        for shard in new_shards[len(old_shards):]:     # least loaded among the unused ones
            candidates = [s for s in range(self.NUM_SHARDS) if s not in used]
            assert loads[shard] == min(loads[s] for s in candidates)
            used.add(shard)
        counts, pages = self._table_counts(), self._pages(rid)
        for pos in range(start, end):
            page = pages[pos // ps]
            assert counts[page] == 1, f"page {page} is shared but written"
            gid = page[0] * self.PAGES_PER_SHARD + page[1]
            assert gid not in alloc._hash_of_page, f"cached page {page} written"
            self.kv.setdefault(page, [None] * ps)[pos % ps] = tuple(tokens[:pos + 1])
        alloc.commit(rid, tokens, end)
        self.computed[rid] = end
        self.history.append(tokens[:end])

    @precondition(lambda self: self.tokens)
    @rule(pick=st.integers(0, 10**6))
    def free(self, pick):
        rid = sorted(self.tokens)[pick % len(self.tokens)]
        self.alloc.free(rid)
        del self.tokens[rid], self.computed[rid]

    def _table_counts(self):
        counts = {}
        for rid in self.tokens:
            for page in self._pages(rid):
                counts[page] = counts.get(page, 0) + 1
        return counts

    @invariant()
    def pages_are_accounted_for(self):
        alloc, ps, per_shard = self.alloc, self.PAGE_SIZE, self.PAGES_PER_SHARD
        counts = self._table_counts()
        assert sum(alloc.num_free_pages_on(s) for s in range(self.NUM_SHARDS)) == (
            alloc.num_free_pages)
        assert alloc.num_free_pages + alloc.num_used_pages == alloc.num_pages
        for shard in range(self.NUM_SHARDS):
            used = {p for (s, p) in counts if s == shard}
            cached = set(alloc._evictable[shard])
            free = set(alloc._free_pages[shard])
            assert len(free) == len(alloc._free_pages[shard])
            assert used | cached | free == set(range(per_shard))
            assert len(used) + len(cached) + len(free) == per_shard
            assert alloc.num_used_pages_on(shard) == len(used)
            for page in range(per_shard):
                gid = shard * per_shard + page
                assert alloc._refcount[gid] == counts.get((shard, page), 0)
                if page in cached:                      # evictable only if registered
                    assert gid in alloc._hash_of_page
                if page in free:                        # a free page names no prefix
                    assert gid not in alloc._hash_of_page
        where = {}
        for rid in self.tokens:
            segments = alloc.segments(rid)
            shards = [seg.shard for seg in segments]
            assert len(set(shards)) == len(shards), f"{rid}: segments share a shard {shards}"
            for k, seg in enumerate(segments):
                assert seg.first_token == k * self.SEGMENT_TOKENS
                assert 0 < len(seg.table) <= self.SEGMENT_TOKENS // ps
                if k < len(segments) - 1:
                    assert len(seg.table) == self.SEGMENT_TOKENS // ps
            pages = self._pages(rid)
            assert len(set(pages)) == len(pages)
            assert len(pages) * ps >= self.computed[rid]
            positions = np.arange(len(pages) * ps)
            got_shards, got_slots = alloc.slot_of(rid, positions)
            assert got_shards.tolist() == [shards[p // self.SEGMENT_TOKENS] for p in positions]
            assert got_slots.tolist() == [pages[p // ps][1] * ps + p % ps for p in positions]
            for i, page in enumerate(pages):
                where.setdefault(page, []).append((rid, i))
        for holders in where.values():
            if len(holders) > 1:   # shared: same index, same full prefix, fully computed
                (rid0, i0), *rest = holders
                prefix = self.tokens[rid0][:(i0 + 1) * ps]
                for rid, i in rest:
                    assert i == i0 and self.tokens[rid][:(i + 1) * ps] == prefix
                    assert self.computed[rid] >= (i + 1) * ps
                assert self.computed[rid0] >= (i0 + 1) * ps

    def teardown(self):
        for rid in list(self.tokens):
            self.alloc.free(rid)
        for shard in range(self.NUM_SHARDS):
            assert self.alloc.num_free_pages_on(shard) == self.PAGES_PER_SHARD
        assert self.alloc.num_used_pages == 0


ShardedWorkload.TestCase.settings = settings(max_examples=80, stateful_step_count=40,
                                             deadline=None)
test_sharded_random_workload = ShardedWorkload.TestCase
