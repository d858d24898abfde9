"""BlockAllocator: page accounting, prefix reuse, eviction order, and a random workload."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from medha_jax.kv_cache.allocator import BlockAllocator, num_pages_for_memory


def _run(alloc, request_id, tokens, *, chunk=None):
    """Allocates a request and computes all its tokens (in chunks), committing after each."""
    done = alloc.allocate(request_id, tokens)
    while done < len(tokens):
        done = min(len(tokens), done + (chunk or len(tokens)))
        assert alloc.reserve(request_id, done)
        alloc.commit(request_id, tokens, done)
    return alloc.page_table(request_id)


def test_pages_needed_and_can_ever_fit():
    alloc = BlockAllocator(num_pages=10, page_size=16)
    assert [alloc.pages_needed(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    assert alloc.can_ever_fit(160) and not alloc.can_ever_fit(161)
    with pytest.raises(ValueError, match="num_tokens=-1"):
        alloc.pages_needed(-1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_pages=0, page_size=16), "num_pages"),
    (dict(num_pages=4, page_size=0), "page_size"),
    (dict(num_pages=4.0, page_size=16), "num_pages"),
])
def test_constructor_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockAllocator(**kwargs)


def test_reserve_grows_table_and_free_returns_every_page():
    alloc = BlockAllocator(num_pages=8, page_size=4)
    assert alloc.allocate("a", [1, 2, 3]) == 0          # nothing cached yet
    assert alloc.reserve("a", 3) and len(alloc.page_table("a")) == 1
    assert alloc.reserve("a", 9) and len(alloc.page_table("a")) == 3
    assert alloc.reserve("a", 5) and len(alloc.page_table("a")) == 3   # never shrinks
    alloc.allocate("b")
    assert alloc.reserve("b", 20)
    assert alloc.num_used_pages == 8 and alloc.num_free_pages == 0
    assert set(alloc.page_table("a")).isdisjoint(alloc.page_table("b"))
    alloc.free("a")
    alloc.free("b")
    assert alloc.num_free_pages == 8 and alloc.num_used_pages == 0
    assert not alloc.has("a")


def test_reserve_shortage_changes_nothing():
    alloc = BlockAllocator(num_pages=4, page_size=4)
    alloc.allocate("a")
    assert alloc.reserve("a", 8)
    alloc.allocate("b")
    assert alloc.reserve("b", 4)
    assert not alloc.reserve("a", 16)                   # needs 2 more, 1 free
    assert alloc.page_table("a") == [0, 1] and alloc.num_free_pages == 1


def test_full_committed_pages_are_reused_and_last_token_is_always_computed():
    alloc = BlockAllocator(num_pages=32, page_size=16)
    prompt = list(range(100, 140))                      # 40 tokens: 2 full pages + 8
    table_a = _run(alloc, "a", prompt)
    assert alloc.num_cached_pages == 2                  # the partial page is never registered
    assert alloc.allocate("same", prompt) == 32
    assert alloc.page_table("same") == table_a[:2]
    # Exactly two pages long: the last page must be recomputed to leave a token to sample.
    assert alloc.allocate("two-pages", prompt[:32]) == 16
    assert alloc.allocate("diverges-in-page-2", prompt[:20] + [7] * 20) == 16
    assert alloc.allocate("diverges-in-page-1", [7] + prompt[1:]) == 0
    assert alloc.allocate("short", prompt[:16]) == 0
    assert alloc.allocate("no-ids") == 0
    assert alloc.page_table("no-ids") == []
    # Shared pages are referenced, not copied.
    assert alloc.num_used_pages == len(table_a)


def test_page_hash_names_the_whole_prefix_not_only_the_page():
    alloc = BlockAllocator(num_pages=16, page_size=4)
    first_a, first_b, second = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    _run(alloc, "a", first_a + second + [9])
    table_b = _run(alloc, "b", first_b + second + [9])
    # Page 2 of "c" holds the same tokens as page 2 of "a", but after a different prefix:
    # only b's pages carry the right K/V.
    assert alloc.allocate("c", first_b + second + [5]) == 8
    assert alloc.page_table("c") == table_b[:2]


def test_incremental_commit_registers_pages_as_they_fill():
    alloc = BlockAllocator(num_pages=32, page_size=8)
    prompt = list(range(50))
    alloc.allocate("a", prompt)
    assert alloc.reserve("a", 12)
    alloc.commit("a", prompt, 12)
    assert alloc.num_cached_pages == 1
    assert alloc.reserve("a", 30)
    alloc.commit("a", prompt, 30)
    assert alloc.num_cached_pages == 3
    alloc.commit("a", prompt, 30)                       # idempotent
    assert alloc.num_cached_pages == 3
    assert alloc.allocate("b", prompt) == 24
    assert alloc.page_table("b") == alloc.page_table("a")[:3]


def test_rename_hands_the_pages_and_their_hashes_to_another_id():
    alloc = BlockAllocator(8, 4)
    tokens = list(range(1, 11))                            # 2 full pages and a partial one
    alloc.allocate("res")
    assert alloc.reserve("res", 10)
    alloc.commit("res", tokens, 8)
    table = alloc.page_table("res")
    assert alloc.rename("res", "req") == 3
    assert not alloc.has("res") and alloc.page_table("req") == table
    alloc.allocate("other")
    with pytest.raises(ValueError, match="already allocated"):
        alloc.rename("other", "req")
    alloc.commit("req", tokens + [11, 12], 12)             # the partial page fills
    alloc.free("req")
    alloc.free("other")
    assert alloc.num_free_pages == 8 and alloc.num_cached_pages == 3
    alloc.allocate("next", tokens + [11, 12, 13])
    assert alloc.page_table("next") == table                # its hashes went with it


def test_freed_prefix_stays_cached_and_eviction_takes_deepest_least_recent_first():
    alloc = BlockAllocator(num_pages=8, page_size=4)
    prompt = list(range(14))                            # 3 full pages + 2 tokens
    table = _run(alloc, "a", prompt)
    alloc.free("a")
    assert alloc.num_free_pages == 8                    # cached pages count as free
    assert alloc.num_cached_pages == 3
    # 5 fresh pages exist; taking 6 evicts exactly one cached page: the deepest one.
    alloc.allocate("big")
    assert alloc.reserve("big", 24)
    assert table[2] in alloc.page_table("big")
    assert table[0] not in alloc.page_table("big") and table[1] not in alloc.page_table("big")
    assert alloc.allocate("again", prompt) == 8
    assert alloc.page_table("again") == table[:2]
    # A page in use is never evicted: the cache has nothing left to give.
    assert alloc.num_free_pages == 0 and not alloc.reserve("again", 12)


def test_identical_prefixes_computed_concurrently_keep_one_cached_copy():
    alloc = BlockAllocator(num_pages=8, page_size=4)
    prompt = list(range(9))
    for rid in ("a", "b"):
        assert alloc.allocate(rid, prompt) == 0
        assert alloc.reserve(rid, 9)
    for rid in ("a", "b"):
        alloc.commit(rid, prompt, 9)
    assert alloc.num_cached_pages == 2                  # a's pages; b's copies stay unregistered
    alloc.free("a")
    alloc.free("b")
    assert alloc.num_free_pages == 8 and alloc.num_cached_pages == 2
    assert alloc.allocate("c", prompt) == 8


def test_prefix_caching_off():
    alloc = BlockAllocator(num_pages=8, page_size=4, enable_prefix_caching=False)
    prompt = list(range(9))
    _run(alloc, "a", prompt)
    assert alloc.allocate("b", prompt) == 0 and alloc.num_cached_pages == 0
    alloc.free("a")
    alloc.free("b")
    assert alloc.num_free_pages == 8


def test_errors_name_the_request_and_values():
    alloc = BlockAllocator(num_pages=4, page_size=4)
    alloc.allocate("a")
    with pytest.raises(ValueError, match="'a' is already allocated"):
        alloc.allocate("a")
    for call in (lambda: alloc.reserve("x", 1), lambda: alloc.commit("x", [1], 1),
                 lambda: alloc.free("x"), lambda: alloc.page_table("x")):
        with pytest.raises(ValueError, match="unknown request 'x'"):
            call()
    with pytest.raises(ValueError, match=r"num_tokens=17 needs 5 pages .* num_pages=4"):
        alloc.reserve("a", 17)
    assert alloc.reserve("a", 4)
    with pytest.raises(ValueError, match="num_computed=5 tokens computed but only 1 pages"):
        alloc.commit("a", list(range(5)), 5)
    with pytest.raises(ValueError, match=r"num_computed=3 must be in \[0, 2\]"):
        alloc.commit("a", [1, 2], 3)


def test_page_table_array_is_a_read_only_view():
    alloc = BlockAllocator(num_pages=4, page_size=4)
    alloc.allocate("a")
    alloc.reserve("a", 10)
    view = alloc.page_table_array("a")
    assert view.tolist() == alloc.page_table("a") and view.dtype.name == "int32"
    with pytest.raises(ValueError):
        view[0] = 3


def test_num_pages_for_memory():
    assert num_pages_for_memory(10_000, 1_000) == 10
    assert num_pages_for_memory(10_999, 1_000) == 10
    with pytest.raises(ValueError, match="bytes_available=999"):
        num_pages_for_memory(999, 1_000)
    with pytest.raises(ValueError, match="kv_bytes_per_page=0"):
        num_pages_for_memory(999, 0)


class AllocatorWorkload(RuleBasedStateMachine):
    """Random allocate / compute (reserve + write + commit) / fork-by-prefix / free.

    A model KV cache records, for every slot written, the whole token prefix it was
    computed from (K/V at a position depend on every token before it). Reusing a page
    is correct only if the model content equals the new request's own prefix, and a
    page that is shared or registered in the prefix cache must never be written.
    """

    PAGE_SIZE = 4
    NUM_PAGES = 8

    def __init__(self):
        super().__init__()
        self.alloc = BlockAllocator(self.NUM_PAGES, self.PAGE_SIZE)
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.history: list[list[int]] = []            # committed prefixes, for forks
        self.kv: dict[int, list[tuple | None]] = {}   # page -> prefix behind each slot
        self.next_id = 0

    def _table_counts(self):
        counts = {}
        for rid in self.tokens:
            for page in self.alloc.page_table(rid):
                counts[page] = counts.get(page, 0) + 1
        return counts

    def _admit(self, tokens):
        rid = f"r{self.next_id}"
        self.next_id += 1
        reused = self.alloc.allocate(rid, tokens)
        ps = self.PAGE_SIZE
        assert reused % ps == 0 and 0 <= reused < len(tokens)
        table = self.alloc.page_table(rid)
        assert len(table) == reused // ps
        for pos in range(reused):
            assert self.kv[table[pos // ps]][pos % ps] == tuple(tokens[:pos + 1])
        self.tokens[rid], self.computed[rid] = tokens, reused

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=24))
    def new_request(self, tokens):
        self._admit(tokens)

    @precondition(lambda self: self.history)
    @rule(pick=st.integers(0, 10**6), keep=st.floats(0, 1),
          suffix=st.lists(st.integers(0, 2), min_size=1, max_size=10))
    def fork_by_prefix(self, pick, keep, suffix):
        source = self.history[pick % len(self.history)]
        self._admit(source[:int(keep * len(source))] + suffix)

    def _pending(self):
        return [rid for rid in self.tokens if self.computed[rid] < len(self.tokens[rid])]

    @precondition(lambda self: self._pending())
    @rule(pick=st.integers(0, 10**6), n=st.integers(1, 12))
    def compute(self, pick, n):
        pending = self._pending()
        rid = pending[pick % len(pending)]
        tokens, start = self.tokens[rid], self.computed[rid]
        end = min(len(tokens), start + n)
        before = (self.alloc.page_table(rid), self.alloc.num_free_pages)
        if not self.alloc.reserve(rid, end):
            assert (self.alloc.page_table(rid), self.alloc.num_free_pages) == before
            return
        table, counts, ps = self.alloc.page_table(rid), self._table_counts(), self.PAGE_SIZE
        for pos in range(start, end):
            page = table[pos // ps]
            assert counts[page] == 1, f"page {page} is shared but written"
            assert page not in self.alloc._hash_of_page, f"cached page {page} written"
            self.kv.setdefault(page, [None] * ps)[pos % ps] = tuple(tokens[:pos + 1])
        self.alloc.commit(rid, tokens, end)
        self.computed[rid] = end
        self.history.append(tokens[:end])

    @precondition(lambda self: self.tokens)
    @rule(pick=st.integers(0, 10**6))
    def free(self, pick):
        rid = sorted(self.tokens)[pick % len(self.tokens)]
        self.alloc.free(rid)
        del self.tokens[rid], self.computed[rid]

    @invariant()
    def pages_are_accounted_for(self):
        alloc, ps = self.alloc, self.PAGE_SIZE
        counts = self._table_counts()
        assert alloc.num_free_pages + alloc.num_used_pages == alloc.num_pages
        assert len(counts) == alloc.num_used_pages
        # Reference counts are internal state; they must match the live page tables.
        assert all(alloc._refcount[p] == counts.get(p, 0) for p in range(alloc.num_pages))
        where = {}
        for rid in self.tokens:
            table = alloc.page_table(rid)
            assert len(set(table)) == len(table)
            assert len(table) * ps >= self.computed[rid]
            for i, page in enumerate(table):
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
        assert self.alloc.num_free_pages == self.alloc.num_pages
        assert self.alloc.num_used_pages == 0


AllocatorWorkload.TestCase.settings = settings(max_examples=80, stateful_step_count=40,
                                               deadline=None)
test_allocator_random_workload = AllocatorWorkload.TestCase
