"""KVReservations: the KV pages a replica's requests hold, as the scheduler books them.

One object owns every allocator call the scheduler makes and a mirror of the tokens each
request's pages can hold, so that a decode, which needs a new page only every page_size
steps, skips the allocator call. The controller and its KV gate both go through it.

The allocator is medha_jax.kv_cache.allocator.BlockAllocator or anything with its
interface (the simulator counts pages without page ids).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from medha_jax.request import Request


class KVAllocator(Protocol):
    """The part of medha_jax.kv_cache.allocator.BlockAllocator the scheduler uses."""

    page_size: int
    num_pages: int

    @property
    def num_free_pages(self) -> int: ...

    def pages_needed(self, num_tokens: int) -> int: ...

    def can_ever_fit(self, num_tokens: int) -> bool: ...

    def allocate(self, request_id: str, token_ids: Sequence[int] | None = None) -> int: ...

    def reserve(self, request_id: str, num_tokens: int) -> bool: ...

    def shards_short(self, request_id: str, num_tokens: int) -> frozenset[int]: ...

    def shards_of(self, request_id: str) -> tuple[int, ...]: ...

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None: ...

    def free(self, request_id: str) -> None: ...

    def rename(self, request_id: str, new_id: str) -> int: ...

    def has(self, request_id: str) -> bool: ...

    def drop_prefix_cache(self) -> None: ...


class TokenView(Sequence):
    """Prompt + output token ids of a request without copying them (for the allocator's hashes)."""

    def __init__(self, request: Request):
        self._request = request

    def __len__(self) -> int:
        return self._request.num_tokens

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError(f"token views support contiguous slices only, got {step=}")
            return self._request.token_ids(start, max(start, stop))
        if index < 0:
            index += len(self)
        return self._request.token_ids(index, index + 1)[0]


class KVReservations:
    """Pages per request: registration (with prefix-cache reuse), growth, commits, release."""

    def __init__(self, allocator: KVAllocator):
        self.allocator = allocator
        self._reserved_tokens: dict[str, int] = {}    # request_id -> tokens its pages hold
        # tokens_held(request_id, default): the tokens its pages hold, for the per-decode
        # fast path (a reserve() of at most that many changes nothing). The dict's own get,
        # read-only and a C call: a read-only mapping view's get costs a third more.
        self.tokens_held: Callable[[str, int], int] = self._reserved_tokens.get
        # has(request_id), as the dict's own C method: the gate asks it of every rider.
        self.has: Callable[[str], bool] = self._reserved_tokens.__contains__
        self._page_size = allocator.page_size

    def register(self, request: Request) -> int:
        """Gives a request without pages its page table; returns how many of its leading
        tokens the prefix cache already holds (0 without token ids).

        A request that asks for prompt logprobs reuses nothing: a reused position is never
        computed, so it would have no logprobs. Its pages are still committed to the prefix
        cache (`commit`) for the requests after it."""
        rid = request.request_id
        if rid in self._reserved_tokens:
            raise ValueError(f"request {rid!r} already holds KV pages")
        reusable = (request.prompt_token_ids is not None
                    and request.sampling.prompt_logprobs is None)
        token_ids = TokenView(request) if reusable else None
        reused = self.allocator.allocate(rid, token_ids)
        self._reserved_tokens[rid] = reused
        return reused

    def adopt(self, request: Request, owner: str) -> None:
        """Gives a request without pages the pages the allocator holds under `owner` (a KV
        hand-off's reservation, written with the request's leading tokens' K/V)."""
        rid = request.request_id
        if rid in self._reserved_tokens:
            raise ValueError(f"request {rid!r} already holds KV pages")
        pages = self.allocator.rename(owner, rid)
        self._reserved_tokens[rid] = pages * self.allocator.page_size

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Grows the request's pages to hold `num_tokens`; False (nothing changed) when the
        cache is short of pages."""
        if num_tokens <= self._reserved_tokens[request_id]:
            return True
        if not self.allocator.reserve(request_id, num_tokens):
            return False
        page_size = self._page_size      # the allocator's pages_needed(num_tokens) pages
        self._reserved_tokens[request_id] = -(-num_tokens // page_size) * page_size
        return True

    def shards_short(self, request_id: str, num_tokens: int) -> frozenset[int]:
        """The KV shards (Medha's KVP groups) where a failed reserve lacks pages: only a
        request holding pages on one of them is worth evicting for it."""
        return self.allocator.shards_short(request_id, num_tokens)

    def holds_pages_on(self, request_id: str, shards: frozenset[int]) -> bool:
        """Whether the request holds pages on any of `shards`."""
        return self.has(request_id) and not shards.isdisjoint(
            self.allocator.shards_of(request_id))

    def commit(self, request: Request, num_computed: int) -> None:
        """Tells the prefix cache the request's first `num_computed` tokens are in its pages."""
        if request.prompt_token_ids is not None:
            self.allocator.commit(request.request_id, TokenView(request), num_computed)

    def release(self, request_id: str) -> None:
        """Frees the request's pages (no-op when it holds none)."""
        if self._reserved_tokens.pop(request_id, None) is not None:
            self.allocator.free(request_id)

    def drop_prefix_cache(self) -> None:
        """Forgets the cached prefixes (their pages' contents were lost); nothing may hold pages."""
        if self._reserved_tokens:
            raise ValueError(f"{len(self._reserved_tokens)} requests still hold KV pages")
        self.allocator.drop_prefix_cache()
