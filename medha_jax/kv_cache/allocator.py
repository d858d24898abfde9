"""Paged KV-cache block allocator over KV-parallel shards, with a reference-counted prefix
cache. Host only, no JAX.

The KV cache is split into `num_shards` pools (Medha's KVP groups; one pool when kvp = 1).
Every pool holds `pages_per_shard` pages of `page_size` token slots
(`k_pages: [pages_per_shard, page_size, kv_heads, head_dim]` on that shard), and page ids
are LOCAL to their shard, in [0, pages_per_shard). This module only does the bookkeeping.

Placement (Medha section 3.3, progressive scaling): a request's tokens are cut into
SEGMENTS of M = `max_tokens_per_shard` tokens (Medha's `max_tokens_per_kvp_group`);
segment k holds tokens [k*M, (k+1)*M) and lives on one shard, and a request's segments are
on distinct shards. A request takes a new shard only when its context outgrows the last
one, so short requests use one shard and a long one is spread over up to num_shards. Segment
0 goes to the least loaded shard (fewest used pages; among equally loaded shards the one
with the fewest cached pages to evict, then the lowest id), so short requests spread over
the shards by load; every later segment goes to the least loaded shard the request does not
use yet. The token at position `pos` of a request lives on the shard of
segment `pos // M`, in slot `pos % page_size` of local page `table[pos // page_size]`, where
`table` lists the request's local page ids in token order (segments concatenated; M is a
multiple of page_size, so every segment starts on a page boundary).

Prefix caching (as in vLLM's automatic prefix caching): once the first
`(i + 1) * page_size` tokens of a request are computed, its page i is FULL and is
registered under a hash that chains the hash of page i - 1 with page i's tokens, so
the hash names the whole prefix, not only this page's tokens. A later request whose
prompt starts with the same tokens (the next turn of a chat, a shared system prompt)
takes those pages by reference instead of recomputing them, as long as each reused page
lies on the shard its segment uses (see `allocate`).

Every page is in exactly one of three places on its shard:
  - used: referenced by at least one live request (refcount > 0);
  - cached: registered under a prefix hash, refcount 0; reusable by a matching
    prefix, and evictable (least recently freed first, per shard) when fresh pages are
    needed on that shard;
  - free: holds nothing worth keeping.
Cached and free pages both count as free capacity, so `num_free_pages + num_used_pages
== num_pages` (the total over shards) always.

Why sharing is safe: a page is shared only when it is full and committed, and a request
that reuses a prefix always recomputes at least its last prompt token (so the sampler has
a query to work from); it therefore never writes a slot of a shared page.

Internally a page is named by its global id `shard * pages_per_shard + local_id` (the
refcounts and the hash maps are keyed by it); with one shard global and local ids coincide.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
from collections.abc import Callable, Sequence

import numpy as np

# Hash of the empty prefix: the start of every chain.
_ROOT_HASH = b""


def _page_hash(parent_hash: bytes, page_token_bytes: bytes) -> bytes:
    """Hash of a prefix: the parent prefix's hash chained with this page's token ids.

    A 128-bit cryptographic digest rather than Python's `hash`, so that two different
    prefixes practically never collide (a collision would hand a request someone else's
    K/V) and the value is the same in every process.
    """
    return hashlib.blake2b(parent_hash + page_token_bytes, digest_size=16).digest()


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as packed int64, the bytes that go into page hashes."""
    return array.array("q", token_ids).tobytes()


def prefix_page_hashes(token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """The hash every full page of `token_ids` is registered under (page i names the
    prefix token_ids[:(i + 1) * page_size]): what a router looks up in the replicas'
    prefix caches (medha_jax.cluster.prefix_index)."""
    hashes, last_hash = [], _ROOT_HASH
    data, bytes_per_page = _token_bytes(token_ids), page_size * 8
    for i in range(len(token_ids) // page_size):
        last_hash = _page_hash(last_hash, data[i * bytes_per_page:(i + 1) * bytes_per_page])
        hashes.append(last_hash)
    return hashes


@dataclasses.dataclass(frozen=True)
class Segment:
    """One shard's part of a request: tokens [first_token, first_token + len(table) * page_size).

    table: int32 [pages] local page ids on `shard`, in token order; a read-only view that is
    valid until the next reserve/free of the request.
    """

    shard: int
    first_token: int
    table: np.ndarray


@dataclasses.dataclass
class _RequestPages:
    # Local page ids in token order: table[:num_pages]; segment k is
    # table[k * pages_per_segment:(k + 1) * pages_per_segment] on shard shards[k]. A numpy
    # buffer with spare capacity rather than a list, so the step builder copies a long
    # context's table with one memcpy instead of converting Python ints one by one.
    table: np.ndarray          # int32 [capacity]
    num_pages: int
    shards: list[int]          # shard of each segment; len == ceil(num_pages / pages_per_segment)
    num_hashed: int            # leading pages whose prefix hash is known (reused or committed)
    last_hash: bytes           # hash of the prefix covered by those pages

    @property
    def pages(self) -> np.ndarray:
        return self.table[:self.num_pages]


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


class BlockAllocator:
    """Hands out KV pages of `num_shards` pools to requests; reuses full pages of shared prefixes.

    `BlockAllocator(pages_per_shard, page_size, *, num_shards=1, max_tokens_per_shard=None,
    enable_prefix_caching=True)`; alternatively `num_pages=` gives the TOTAL page count
    (sized from memory), which must divide evenly over the shards. With num_shards=1 the two
    are the same and one segment spans the whole pool.

    Lifecycle of a request (driven by the scheduler):
      allocate(id, prompt)   -> prefix tokens reused from the cache (the first chunk starts there)
      reserve(id, n)         -> room for the first n tokens, before a step computes them
      commit(id, tokens, n)  -> after the step: full pages of the first n tokens become reusable
      free(id)               -> on finish, cancel or preemption
    rename(id, new_id) hands a request's pages to another id (a KV hand-off's reservation to
    the request that decodes from it).
    Step inputs: segments(id) (per-shard page tables) and slot_of(id, positions); with one
    shard also page_table(id) / page_table_array(id).

    on_cache_change(stored, removed, cleared=False, orphaned=(), adopted=()): called with
    the page hashes a commit registered, an eviction dropped, or cleared=True when the whole
    prefix cache is dropped: what a router's prefix index follows
    (medha_jax.cluster.prefix_index.PrefixIndex). orphaned / adopted: registered pages whose
    parent prefix page just stopped / started being registered (orphans, `orphan_hashes`).
    A listener attached after construction calls `restate_cache()` (without it, events
    carry orphaned=None: the orphans are followed only for a listener, they cost a few
    dict operations per page).

    Orphans: a registered page whose parent page is not. Eviction is least recently freed
    first and a request frees its deepest page first, so a parent normally outlives its
    children, but not always: a page computed twice at once stays registered under the
    first copy, which may be evicted while the second request's next pages stay (and with
    several shards each pool evicts on its own). No request can reuse an orphan (reuse
    stops at the first missing page) until its parent is registered again; the prefix index
    needs them to know where a replica's pages have holes.
    """

    def __init__(self, pages_per_shard: int | None = None, page_size: int | None = None, *,
                 num_shards: int = 1, max_tokens_per_shard: int | None = None,
                 enable_prefix_caching: bool = True, num_pages: int | None = None,
                 on_cache_change: Callable[..., None] | None = None):
        _check_positive_int("num_shards", num_shards)
        if num_pages is not None:
            if pages_per_shard is not None:
                raise ValueError(
                    f"give pages_per_shard={pages_per_shard!r} or the total num_pages="
                    f"{num_pages!r}, not both")
            _check_positive_int("num_pages", num_pages)
            if num_pages % num_shards:
                raise ValueError(
                    f"{num_pages=} pages do not divide evenly over {num_shards=} shards")
            pages_per_shard = num_pages // num_shards
        _check_positive_int("pages_per_shard", pages_per_shard)
        _check_positive_int("page_size", page_size)
        pool_tokens = pages_per_shard * page_size
        if max_tokens_per_shard is None:
            max_tokens_per_shard = pool_tokens
        _check_positive_int("max_tokens_per_shard", max_tokens_per_shard)
        if max_tokens_per_shard % page_size:
            raise ValueError(
                f"{max_tokens_per_shard=} must be a multiple of {page_size=} so that every "
                f"segment starts on a page boundary")
        if max_tokens_per_shard > pool_tokens:
            # A longer segment could never be filled: its shard's pool runs out first.
            raise ValueError(
                f"{max_tokens_per_shard=} exceeds one shard's pool of {pages_per_shard=} "
                f"pages x {page_size=} = {pool_tokens} tokens")
        self.pages_per_shard = pages_per_shard
        self.num_shards = num_shards
        self.num_pages = pages_per_shard * num_shards
        self.page_size = page_size
        self.max_tokens_per_shard = max_tokens_per_shard
        self.enable_prefix_caching = enable_prefix_caching
        self._pages_per_segment = max_tokens_per_shard // page_size
        self._refcount = [0] * self.num_pages                    # by global page id
        # Per shard, local ids. A stack, so a freed page is reused first (warm in caches);
        # page 0 is handed out first.
        self._free_pages = [list(range(pages_per_shard - 1, -1, -1)) for _ in range(num_shards)]
        # Per shard, cached local ids with refcount 0, least recently freed first: the
        # eviction order.
        self._evictable: list[collections.OrderedDict[int, None]] = [
            collections.OrderedDict() for _ in range(num_shards)]
        self._page_of_hash: dict[bytes, int] = {}                # hash -> global page id
        self._hash_of_page: dict[int, bytes] = {}                # global page id -> hash
        # The tree of registered prefixes, for the orphans: a registered hash's parent hash
        # (absent for first pages: the root is always there); once a listener follows them
        # (`_follows_orphans`), also the registered children of a hash (registered or
        # not) and the registered hashes whose parent is not.
        self._parent_of_hash: dict[bytes, bytes] = {}
        self._children_of_hash: dict[bytes, set[bytes]] = {}
        self._orphans: set[bytes] = set()
        self._follows_orphans = on_cache_change is not None
        self._requests: dict[str, _RequestPages] = {}
        self.on_cache_change = on_cache_change

    # ----------------------------------------------------------------- capacity

    @property
    def num_free_pages(self) -> int:
        """Pages a reserve can still take, over all shards: free plus evictable cached ones."""
        return sum(map(len, self._free_pages)) + sum(map(len, self._evictable))

    def num_free_pages_on(self, shard: int) -> int:
        """Free plus evictable cached pages of one shard's pool."""
        self._check_shard(shard)
        return len(self._free_pages[shard]) + len(self._evictable[shard])

    def num_used_pages_on(self, shard: int) -> int:
        """Pages of one shard referenced by a live request: the load placement balances."""
        return self.pages_per_shard - self.num_free_pages_on(shard)

    @property
    def num_used_pages(self) -> int:
        """Pages referenced by at least one live request."""
        return self.num_pages - self.num_free_pages

    @property
    def orphan_hashes(self) -> tuple[bytes, ...] | None:
        """Registered page hashes whose parent page is not registered (see the class doc);
        None until a listener follows them."""
        return tuple(self._orphans) if self._follows_orphans else None

    @property
    def num_cached_pages(self) -> int:
        """Pages registered in the prefix cache, in use or not."""
        return len(self._hash_of_page)

    @property
    def max_tokens_per_request(self) -> int:
        """The longest context one request can hold: one full segment on every shard."""
        return self.num_shards * self.max_tokens_per_shard

    def pages_needed(self, num_tokens: int) -> int:
        """Total pages (over all shards) that hold num_tokens tokens; segments are page-aligned."""
        if num_tokens < 0:
            raise ValueError(f"{num_tokens=} must be >= 0")
        return -(-num_tokens // self.page_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether one request of num_tokens tokens fits in the whole cache.

        Each segment fits its pool by construction (max_tokens_per_shard <= the pool), so
        the only limit is one segment per shard.
        """
        return self.pages_needed(num_tokens) * self.page_size <= self.max_tokens_per_request

    # ----------------------------------------------------------------- requests

    def has(self, request_id: str) -> bool:
        return request_id in self._requests

    def segments(self, request_id: str) -> list[Segment]:
        """The request's segments in token order: shard, first token and local page table.

        The tables are read-only views, valid until the request's next reserve/free.
        """
        req = self._get(request_id)
        per_segment = self._pages_per_segment
        pages = req.pages
        pages.flags.writeable = False
        return [Segment(shard, k * self.max_tokens_per_shard,
                        pages[k * per_segment:(k + 1) * per_segment])
                for k, shard in enumerate(req.shards)]

    def slot_of(self, request_id: str, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where the K/V of token positions live: (shards int32 [n], local_slots int32 [n]).

        positions: int [n] token positions of the request, each inside its reserved pages.
        local_slot = local_page * page_size + pos % page_size, a row of that shard's
        `[pages_per_shard * page_size]` flattened slot space. A few microseconds a call
        whatever n; a builder of a whole batch's slots vectorises over the concatenated
        segments() tables instead (owner shard of token pos = its segment's shard,
        segment = pos // max_tokens_per_shard).
        """
        req = self._get(request_id)
        positions = np.asarray(positions)
        if positions.ndim != 1:
            raise ValueError(f"positions must be 1-D, got shape {positions.shape}")
        capacity = req.num_pages * self.page_size
        if positions.size and (positions.min() < 0 or positions.max() >= capacity):
            raise ValueError(
                f"request {request_id!r}: positions in [{positions.min()}, {positions.max()}] "
                f"outside the {capacity} reserved token slots; reserve first")
        page_index, offset = np.divmod(positions, self.page_size)
        shards = np.asarray(req.shards, np.int32)[positions // self.max_tokens_per_shard]
        local_slots = req.table[page_index] * np.int32(self.page_size) + offset.astype(np.int32)
        return shards, local_slots.astype(np.int32, copy=False)

    def page_table(self, request_id: str) -> list[int]:
        """A copy of the request's page ids, in token order. Only for num_shards == 1.

        With several shards a page id means nothing without its shard: use segments().
        """
        return self.page_table_array(request_id).tolist()

    def page_table_array(self, request_id: str) -> np.ndarray:
        """The request's page ids as a read-only int32 view, valid until its next reserve/free.

        The fast path of the one-shard step builder; everything else uses page_table(). Only
        for num_shards == 1 (use segments() otherwise).
        """
        if self.num_shards != 1:
            raise ValueError(
                f"page_table of request {request_id!r} is only defined for num_shards=1, this "
                f"allocator has num_shards={self.num_shards}: use segments() or slot_of()")
        view = self._get(request_id).pages
        view.flags.writeable = False
        return view

    def allocate(self, request_id: str, token_ids: Sequence[int] | None = None) -> int:
        """Registers a request and takes the cached full pages of its prefix.

        Returns the number of prefix tokens whose K/V are reused: a multiple of page_size,
        and always < len(token_ids), so at least the last token is computed (its logits
        are needed to sample). 0 without token ids or with prefix caching off.

        Reuse follows placement: the shard of the first cached prefix page becomes segment
        0's shard, and reuse stops at the first page on another shard. At the start of
        segment k > 0 the cached page may lie on any shard the request does not use yet,
        which then becomes segment k's shard.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already allocated; free it first")
        pages: list[int] = []                  # global ids
        shards: list[int] = []
        last_hash = _ROOT_HASH
        if self.enable_prefix_caching and token_ids is not None and len(token_ids) > 0:
            ps, per_shard = self.page_size, self.pages_per_shard
            per_segment = self._pages_per_segment
            max_reused_pages = (len(token_ids) - 1) // ps
            data = _token_bytes(token_ids[:max_reused_pages * ps])
            bytes_per_page = ps * 8
            for i in range(max_reused_pages):
                h = _page_hash(last_hash, data[i * bytes_per_page:(i + 1) * bytes_per_page])
                page = self._page_of_hash.get(h)
                if page is None:
                    break
                shard = page // per_shard
                if i % per_segment == 0:       # first page of a segment: picks its shard
                    if shard in shards:
                        break
                    shards.append(shard)
                elif shard != shards[-1]:
                    break
                pages.append(page)
                last_hash = h
            for page in pages:
                if self._refcount[page] == 0:
                    del self._evictable[page // per_shard][page % per_shard]
                self._refcount[page] += 1
        table = np.array(pages, np.int32) % np.int32(self.pages_per_shard)
        self._requests[request_id] = _RequestPages(
            table, len(pages), shards, len(pages), last_hash)
        return len(pages) * self.page_size

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Grows the request's segments to hold its first num_tokens tokens.

        Grows the last segment on its shard, then opens new segments, each on the least
        loaded shard the request does not use yet. On each shard it takes free pages first,
        then evicts cached ones (least recently freed first). All or nothing: on shortage
        nothing changes and False is returned. Never shrinks. Afterwards the request holds
        pages_needed(num_tokens) pages.
        """
        req = self._get(request_id)
        needed = self.pages_needed(num_tokens)
        if not self.can_ever_fit(num_tokens):
            raise ValueError(
                f"request {request_id!r}: {num_tokens=} needs {needed} pages of "
                f"{self.page_size} tokens but one request can hold at most "
                f"{self.max_tokens_per_request} tokens: the cache has num_pages={self.num_pages} "
                f"over num_shards={self.num_shards} and one segment of max_tokens_per_shard="
                f"{self.max_tokens_per_shard} per shard")
        if needed <= req.num_pages:
            return True
        plan = self._plan(req, needed)
        if any(count > self.num_free_pages_on(shard) for shard, count in plan):
            return False
        if needed > len(req.table):
            grown = np.empty(max(needed, 2 * len(req.table)), np.int32)
            grown[:req.num_pages] = req.pages
            req.table = grown
        i = req.num_pages
        evicted: list[bytes] = []
        orphaned: list[bytes] = []
        for shard, count in plan:
            if shard != (req.shards[-1] if req.shards else None):
                req.shards.append(shard)
            free_pages, evictable = self._free_pages[shard], self._evictable[shard]
            base = shard * self.pages_per_shard
            for _ in range(count):
                if free_pages:
                    page = free_pages.pop()
                else:
                    page, _ = evictable.popitem(last=False)
                    evicted.append(self._hash_of_page.pop(base + page))
                    del self._page_of_hash[evicted[-1]]
                    parent = self._parent_of_hash.pop(evicted[-1], None)
                    if self._follows_orphans:
                        self._unlink_hash(evicted[-1], parent, orphaned)
                self._refcount[base + page] = 1
                req.table[i] = page
                i += 1
        req.num_pages = needed
        if evicted and self.on_cache_change is not None:
            # A child evicted after its parent in this batch is no orphan any more.
            self.on_cache_change((), evicted, orphaned=tuple(
                h for h in orphaned if h in self._orphans) if self._follows_orphans else None,
                adopted=())
        return True

    def shards_short(self, request_id: str, num_tokens: int) -> frozenset[int]:
        """The shards whose missing pages make reserve(request_id, num_tokens) fail: empty
        when it would succeed.

        Freeing pages on other shards cannot make it succeed (a preemption there frees
        nothing the request can use); freeing enough on these can. Growing the last
        segment needs pages on that segment's shard. A new segment may go to any shard the
        request does not use yet, so those count, except the ones that already have room
        for the largest new segment (more room there changes nothing).
        """
        req = self._get(request_id)
        needed = self.pages_needed(num_tokens)
        if needed <= req.num_pages or not self.can_ever_fit(num_tokens):
            return frozenset()
        plan = self._plan(req, needed)
        if all(count <= self.num_free_pages_on(shard) for shard, count in plan):
            return frozenset()
        short = set()
        if req.shards and plan[0][0] == req.shards[-1]:
            shard, count = plan.pop(0)
            if count > self.num_free_pages_on(shard):
                short.add(shard)
        if any(count > self.num_free_pages_on(shard) for shard, count in plan):
            largest = max(count for _, count in plan)    # the first new segment's
            short.update(s for s in range(self.num_shards)
                         if s not in req.shards and self.num_free_pages_on(s) < largest)
        return frozenset(short)

    def shards_of(self, request_id: str) -> tuple[int, ...]:
        """The shards the request holds pages on, in token order (empty before its first
        page)."""
        return tuple(self._get(request_id).shards)

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Registers the prefix hashes of the pages fully covered by the first num_computed tokens.

        token_ids are the request's tokens from position 0 (at least num_computed of them).
        Pages already registered for this request are skipped, so calling this after every
        step costs only the pages that became full. When an identical prefix is already
        cached under another page (two requests computed it at the same time), this page
        stays unregistered and returns to the free list when the request is freed.
        """
        req = self._get(request_id)
        if not 0 <= num_computed <= len(token_ids):
            raise ValueError(
                f"request {request_id!r}: {num_computed=} must be in [0, {len(token_ids)}] "
                f"(the number of token ids given)")
        capacity = req.num_pages * self.page_size
        if num_computed > capacity:
            raise ValueError(
                f"request {request_id!r}: {num_computed=} tokens computed but only "
                f"{req.num_pages} pages ({capacity} tokens) are reserved")
        num_full = num_computed // self.page_size
        if not self.enable_prefix_caching or num_full <= req.num_hashed:
            return
        ps, per_segment = self.page_size, self._pages_per_segment
        bytes_per_page = ps * 8
        data = _token_bytes(token_ids[req.num_hashed * ps:num_full * ps])
        last_hash = req.last_hash
        stored: list[bytes] = []
        orphaned: list[bytes] = []
        adopted: list[bytes] = []
        for offset, i in enumerate(range(req.num_hashed, num_full)):
            page_bytes = data[offset * bytes_per_page:(offset + 1) * bytes_per_page]
            parent, last_hash = last_hash, _page_hash(last_hash, page_bytes)
            if last_hash not in self._page_of_hash:
                page = req.shards[i // per_segment] * self.pages_per_shard + int(req.table[i])
                self._page_of_hash[last_hash] = page
                self._hash_of_page[page] = last_hash
                stored.append(last_hash)
                if parent != _ROOT_HASH:
                    self._parent_of_hash[last_hash] = parent
                if self._follows_orphans:
                    self._link_hash(last_hash, parent, orphaned, adopted)
        req.num_hashed, req.last_hash = num_full, last_hash
        if stored and self.on_cache_change is not None:
            self.on_cache_change(stored, (), orphaned=tuple(orphaned)
                                 if self._follows_orphans else None, adopted=tuple(adopted))

    def restate_cache(self) -> None:
        """Sends the whole prefix cache to on_cache_change as one event (cleared, then every
        registered page stored and every orphan named), and follows the orphans from now
        on: for a listener attached after construction, so that it starts from what this
        allocator holds."""
        if not self._follows_orphans:
            for h, parent in self._parent_of_hash.items():
                self._children_of_hash.setdefault(parent, set()).add(h)
                if parent not in self._page_of_hash:
                    self._orphans.add(h)
            self._follows_orphans = True
        if self.on_cache_change is not None:
            self.on_cache_change(tuple(self._page_of_hash), (), cleared=True,
                                 orphaned=self.orphan_hashes, adopted=())

    def _link_hash(self, h: bytes, parent: bytes, orphaned: list[bytes],
                   adopted: list[bytes]) -> None:
        """h was just registered under `parent`: it is an orphan if the parent is not
        registered, and the children registered before it are orphans no more."""
        children_of = self._children_of_hash
        if parent != _ROOT_HASH:
            siblings = children_of.get(parent)
            if siblings is None:
                children_of[parent] = {h}
            else:
                siblings.add(h)
            if parent not in self._page_of_hash:
                self._orphans.add(h)
                orphaned.append(h)
        children = children_of.get(h)
        if children:
            self._orphans.difference_update(children)
            adopted.extend(children)

    def _unlink_hash(self, h: bytes, parent: bytes | None, orphaned: list[bytes]) -> None:
        """h (under `parent`, None for a first page) was just evicted: its registered
        children become orphans."""
        children_of = self._children_of_hash
        if parent is not None:
            siblings = children_of[parent]
            if len(siblings) == 1:
                del children_of[parent]
            else:
                siblings.discard(h)
        if self._orphans:
            self._orphans.discard(h)
        children = children_of.get(h)
        if children:
            self._orphans.update(children)
            orphaned.extend(children)

    def rename(self, request_id: str, new_id: str) -> int:
        """Hands request_id's pages, and what is known of their prefix hashes, to new_id
        (a KV hand-off's reservation to the request that decodes from it). Returns how
        many pages new_id holds."""
        if new_id in self._requests:
            raise ValueError(f"request {new_id!r} is already allocated; free it first")
        req = self._get(request_id)
        del self._requests[request_id]
        self._requests[new_id] = req
        return req.num_pages

    def free(self, request_id: str) -> None:
        """Drops the request's references; registered pages stay cached (evictable), others free.

        Every page returns to its own shard's pool.
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            raise ValueError(f"cannot free unknown request {request_id!r}")
        per_segment, per_shard = self._pages_per_segment, self.pages_per_shard
        # Last page first, so that among one request's pages the deepest prefix is evicted
        # first and the shared beginnings (system prompts) stay cached the longest.
        for k in range(len(req.shards) - 1, -1, -1):
            shard = req.shards[k]
            base = shard * per_shard
            free_pages, evictable = self._free_pages[shard], self._evictable[shard]
            segment = req.table[k * per_segment:min((k + 1) * per_segment, req.num_pages)]
            for page in reversed(segment.tolist()):
                self._refcount[base + page] -= 1
                if self._refcount[base + page] == 0:
                    if base + page in self._hash_of_page:
                        evictable[page] = None
                    else:
                        free_pages.append(page)

    def drop_prefix_cache(self) -> None:
        """Forgets every cached prefix: the pages' contents were lost (the device cache was
        rebuilt after a failed step). Only with no request holding pages; cached pages
        become free."""
        if self._requests:
            raise ValueError(f"{len(self._requests)} requests still hold pages; free them "
                             "before dropping the prefix cache")
        for shard in range(self.num_shards):
            self._free_pages[shard].extend(reversed(self._evictable[shard]))
            self._evictable[shard].clear()
        self._page_of_hash.clear()
        self._hash_of_page.clear()
        self._parent_of_hash.clear()
        self._children_of_hash.clear()
        self._orphans.clear()
        if self.on_cache_change is not None:
            self.on_cache_change((), (), cleared=True, orphaned=self.orphan_hashes, adopted=())

    def _get(self, request_id: str) -> _RequestPages:
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"unknown request {request_id!r}: allocate it first")
        return req

    def _plan(self, req: _RequestPages, needed: int) -> list[tuple[int, int]]:
        """Which shard gives how many pages to table[req.num_pages:needed], in token order:
        first the last segment's own shard (growing it), then one new segment per entry."""
        per_segment = self._pages_per_segment
        plan: list[tuple[int, int]] = []
        start = req.num_pages
        if req.shards:
            last_end = min(len(req.shards) * per_segment, needed)
            if last_end > start:
                plan.append((req.shards[-1], last_end - start))
                start = last_end
        used_shards = set(req.shards)
        while start < needed:
            # Least loaded also means most free pages, so if this shard cannot take the
            # segment no other unused one can; segments before the last are full, so the
            # biggest demands go to the emptiest shards.
            shard = min((s for s in range(self.num_shards) if s not in used_shards),
                        key=self._placement_key)
            used_shards.add(shard)
            end = min(start + per_segment, needed)
            plan.append((shard, end - start))
            start = end
        return plan

    def _placement_key(self, shard: int) -> tuple[int, int, int]:
        """Order of preference for a new segment: fewest used pages, then (among equally
        loaded shards) fewest cached pages it would have to evict, then the lowest id."""
        return (self.num_used_pages_on(shard), -len(self._free_pages[shard]), shard)

    def _check_shard(self, shard: int) -> None:
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"{shard=} must be in [0, num_shards={self.num_shards})")


def free_if_held(allocator, request_id: str) -> bool:
    """Frees `request_id`'s pages if `allocator` (any KV allocator) holds that id: for
    reservations and holds that their request may already have taken or freed. Returns
    whether it held them."""
    if not allocator.has(request_id):
        return False
    allocator.free(request_id)
    return True


def num_pages_for_memory(bytes_available: int, kv_bytes_per_page: int) -> int:
    """How many KV pages fit in bytes_available (K and V of all layers per page)."""
    if kv_bytes_per_page < 1:
        raise ValueError(f"{kv_bytes_per_page=} must be >= 1")
    num_pages = bytes_available // kv_bytes_per_page
    if num_pages < 1:
        raise ValueError(
            f"{bytes_available=} holds no KV page of {kv_bytes_per_page=} bytes; "
            f"free memory or shrink page_size")
    return num_pages
