"""Paged KV-cache block allocator with a reference-counted prefix cache. Host only, no JAX.

The KV cache of every layer is `num_pages` pages of `page_size` token slots
(`k_pages: [num_pages, page_size, kv_heads, head_dim]`). This module only does the
bookkeeping: each live request holds a page table (page ids in token order), and the
token at position `pos` of a request lives in slot `pos % page_size` of page
`page_table[pos // page_size]`.

Prefix caching (as in vLLM's automatic prefix caching): once the first
`(i + 1) * page_size` tokens of a request are computed, its page i is FULL and is
registered under a hash that chains the hash of page i - 1 with page i's tokens, so
the hash names the whole prefix, not only this page's tokens. A later request whose
prompt starts with the same tokens (the next turn of a chat, a shared system prompt)
takes those pages by reference instead of recomputing them.

Every page is in exactly one of three places:
  - used: referenced by at least one live request (refcount > 0);
  - cached: registered under a prefix hash, refcount 0; reusable by a matching
    prefix, and evictable (least recently freed first) when fresh pages are needed;
  - free: holds nothing worth keeping.
Cached and free pages both count as free capacity, so `num_free_pages + num_used_pages
== num_pages` always.

Why sharing is safe: a page is shared only when it is full and committed, and a request
that reuses a prefix always recomputes at least its last prompt token (so the sampler has
a query to work from); it therefore never writes a slot of a shared page.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
from collections.abc import Sequence

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


@dataclasses.dataclass
class _RequestPages:
    # Page ids in token order: table[:num_pages]. A numpy buffer with spare capacity
    # rather than a list, so the step builder copies a long context's table with one
    # memcpy instead of converting Python ints one by one (which costs ~20 ns a page).
    table: np.ndarray          # int32 [capacity]
    num_pages: int
    num_hashed: int            # leading pages whose prefix hash is known (reused or committed)
    last_hash: bytes           # hash of the prefix covered by those pages

    @property
    def pages(self) -> np.ndarray:
        return self.table[:self.num_pages]


class BlockAllocator:
    """Hands out KV pages to requests; reuses full pages of shared prefixes.

    Lifecycle of a request (driven by the scheduler):
      allocate(id, prompt)   -> prefix tokens reused from the cache (the first chunk starts there)
      reserve(id, n)         -> room for the first n tokens, before a step computes them
      commit(id, tokens, n)  -> after the step: full pages of the first n tokens become reusable
      free(id)               -> on finish, cancel or preemption
    """

    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_caching: bool = True):
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ValueError(f"num_pages must be an int >= 1, got {num_pages!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refcount = [0] * num_pages
        # A stack, so a freed page is reused first (warm in caches); page 0 is handed out first.
        self._free_pages = list(range(num_pages - 1, -1, -1))
        # Cached pages with refcount 0, least recently freed first: the eviction order.
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._page_of_hash: dict[bytes, int] = {}
        self._hash_of_page: dict[int, bytes] = {}
        self._requests: dict[str, _RequestPages] = {}

    # ----------------------------------------------------------------- capacity

    @property
    def num_free_pages(self) -> int:
        """Pages a reserve can still take: free ones plus evictable cached ones."""
        return len(self._free_pages) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        """Pages referenced by at least one live request."""
        return self.num_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        """Pages registered in the prefix cache, in use or not."""
        return len(self._hash_of_page)

    def pages_needed(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"{num_tokens=} must be >= 0")
        return -(-num_tokens // self.page_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether one request of num_tokens tokens fits in the whole cache."""
        return self.pages_needed(num_tokens) <= self.num_pages

    # ----------------------------------------------------------------- requests

    def has(self, request_id: str) -> bool:
        return request_id in self._requests

    def page_table(self, request_id: str) -> list[int]:
        """A copy of the request's page ids, in token order."""
        return self._get(request_id).pages.tolist()

    def page_table_array(self, request_id: str) -> np.ndarray:
        """The request's page ids as a read-only int32 view, valid until its next reserve/free.

        The fast path of the step builder; everything else uses page_table().
        """
        view = self._get(request_id).pages
        view.flags.writeable = False
        return view

    def allocate(self, request_id: str, token_ids: Sequence[int] | None = None) -> int:
        """Registers a request and takes the cached full pages of its prefix.

        Returns the number of prefix tokens whose K/V are reused: a multiple of page_size,
        and always < len(token_ids), so at least the last token is computed (its logits
        are needed to sample). 0 without token ids or with prefix caching off.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already allocated; free it first")
        pages: list[int] = []
        last_hash = _ROOT_HASH
        if self.enable_prefix_caching and token_ids is not None and len(token_ids) > 0:
            ps = self.page_size
            max_reused_pages = (len(token_ids) - 1) // ps
            data = _token_bytes(token_ids[:max_reused_pages * ps])
            bytes_per_page = ps * 8
            for i in range(max_reused_pages):
                h = _page_hash(last_hash, data[i * bytes_per_page:(i + 1) * bytes_per_page])
                page = self._page_of_hash.get(h)
                if page is None:
                    break
                pages.append(page)
                last_hash = h
            for page in pages:
                if self._refcount[page] == 0:
                    del self._evictable[page]
                self._refcount[page] += 1
        table = np.array(pages, np.int32)
        self._requests[request_id] = _RequestPages(table, len(pages), len(pages), last_hash)
        return len(pages) * self.page_size

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Grows the request's page table to hold its first num_tokens tokens.

        Takes free pages first, then evicts cached ones (least recently freed first).
        On shortage nothing changes and False is returned. Never shrinks a table.
        """
        req = self._get(request_id)
        needed = self.pages_needed(num_tokens)
        if needed > self.num_pages:
            raise ValueError(
                f"request {request_id!r}: {num_tokens=} needs {needed} pages of "
                f"{self.page_size} tokens but the whole cache has num_pages={self.num_pages}")
        extra = needed - req.num_pages
        if extra <= 0:
            return True
        if extra > self.num_free_pages:
            return False
        if needed > len(req.table):
            grown = np.empty(max(needed, 2 * len(req.table)), np.int32)
            grown[:req.num_pages] = req.pages
            req.table = grown
        for i in range(req.num_pages, needed):
            if self._free_pages:
                page = self._free_pages.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_of_hash[self._hash_of_page.pop(page)]
            self._refcount[page] = 1
            req.table[i] = page
        req.num_pages = needed
        return True

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
        ps = self.page_size
        bytes_per_page = ps * 8
        data = _token_bytes(token_ids[req.num_hashed * ps:num_full * ps])
        last_hash = req.last_hash
        for offset, i in enumerate(range(req.num_hashed, num_full)):
            page_bytes = data[offset * bytes_per_page:(offset + 1) * bytes_per_page]
            last_hash = _page_hash(last_hash, page_bytes)
            if last_hash not in self._page_of_hash:
                page = int(req.table[i])
                self._page_of_hash[last_hash] = page
                self._hash_of_page[page] = last_hash
        req.num_hashed, req.last_hash = num_full, last_hash

    def free(self, request_id: str) -> None:
        """Drops the request's references; registered pages stay cached (evictable), others free."""
        req = self._requests.pop(request_id, None)
        if req is None:
            raise ValueError(f"cannot free unknown request {request_id!r}")
        # Last page first, so that among one request's pages the deepest prefix is evicted
        # first and the shared beginnings (system prompts) stay cached the longest.
        for page in reversed(req.pages.tolist()):
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                if page in self._hash_of_page:
                    self._evictable[page] = None
                else:
                    self._free_pages.append(page)

    def _get(self, request_id: str) -> _RequestPages:
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"unknown request {request_id!r}: allocate it first")
        return req


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
