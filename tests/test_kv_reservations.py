"""KVReservations: the scheduler's one door to the KV allocator."""

import pytest

from medha_jax.kv_cache.allocator import BlockAllocator
from medha_jax.request import Request
from medha_jax.scheduler import KVReservations


def test_reserve_skips_the_allocator_until_a_new_page_is_needed():
    allocator = BlockAllocator(num_pages=4, page_size=16)
    kv = KVReservations(allocator)
    request = Request("a", 20, 4, 0.0, prompt_token_ids=list(range(20)))
    assert kv.register(request) == 0 and kv.has("a")
    with pytest.raises(ValueError, match="request 'a' already holds KV pages"):
        kv.register(request)
    assert kv.reserve("a", 20) and allocator.num_free_pages == 2
    calls = []
    real = allocator.reserve
    allocator.reserve = lambda *args: calls.append(args) or real(*args)
    assert kv.reserve("a", 32) and calls == []           # inside the second page already
    assert kv.reserve("a", 33) and len(calls) == 1 and allocator.num_free_pages == 1
    kv.register(Request("b", 20, 4, 0.0))
    assert kv.reserve("b", 16) and allocator.num_free_pages == 0
    assert not kv.reserve("a", 64) and allocator.num_free_pages == 0   # short: nothing changes
    kv.release("b")
    kv.release("a")
    kv.release("a")                                      # idempotent
    assert not kv.has("a") and allocator.num_free_pages == 4


def test_committed_prefix_is_reused_by_the_next_request():
    allocator = BlockAllocator(num_pages=8, page_size=16)
    kv = KVReservations(allocator)
    first = Request("first", 40, 2, 0.0, prompt_token_ids=list(range(40)))
    kv.register(first)
    kv.reserve("first", 40)
    kv.commit(first, 40)
    kv.release("first")
    second = Request("second", 50, 2, 0.0, prompt_token_ids=list(range(40)) + [7] * 10)
    assert kv.register(second) == 32                     # two full pages of the shared prefix


@pytest.mark.parametrize("counting", [False, True], ids=["block", "counting"])
def test_where_a_reserve_lacks_pages_and_who_holds_pages_there(counting):
    """The KV gate's question when a reserve fails: which shards, and who holds pages on
    them. The simulator's CountingAllocator answers it as one shard."""
    from medha_jax.simulator import CountingAllocator

    if counting:
        allocator, shard_of_b = CountingAllocator(4, 16), 0
    else:
        allocator, shard_of_b = BlockAllocator(2, 16, num_shards=2), 1
    kv = KVReservations(allocator)
    for rid, tokens in (("a", 32), ("b", 16)):
        kv.register(Request(rid, tokens, 1, 0.0))
        assert kv.reserve(rid, tokens)
    kv.register(Request("c", 16, 1, 0.0))                # holds no page yet
    assert kv.shards_short("b", 32) == frozenset()       # the one free page is b's to take
    # a's shard is full: a new segment on the other one. c could go anywhere.
    assert kv.shards_short("a", 64) == frozenset({0} if counting else {1})
    assert kv.shards_short("c", 32) == frozenset({0} if counting else {0, 1})
    assert kv.holds_pages_on("a", frozenset({0}))
    assert kv.holds_pages_on("b", frozenset({shard_of_b}))
    assert not kv.holds_pages_on("a", frozenset({1})) and not kv.holds_pages_on("b", frozenset())
    assert not kv.holds_pages_on("c", frozenset({0, 1})) and not kv.holds_pages_on(
        "x", frozenset({0}))
