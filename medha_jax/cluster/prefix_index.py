"""Which replica holds which prefix: an exact index of the replicas' prefix-cache pages.

Every replica's `BlockAllocator` registers a full page under a hash that chains the whole
prefix before it (`medha_jax.kv_cache.allocator.prefix_page_hashes`), so a prompt's page
hashes name its prefixes exactly: the router hashes a prompt once and asks, for every
replica at once, how many of its leading pages that replica holds. The index is fed by the
allocators' cache events (`CacheEvent`: pages stored, pages removed, everything cleared),
numbered per replica so that a lost event is detected and the replica's entries dropped
until it resends its state (Dynamo's KV router does the same with its event stream).

Inside a process the allocators call `PrefixIndex.listener(replica)` directly; across
processes a replica ships the same events. Between a routing decision and the events that
confirm it (the prefill has not computed the pages yet), the router marks the prompt's pages
as held by the chosen replica for `speculative_ttl_s` (vLLM's router: 2 s), so two requests
of one session a moment apart land together.

Pure Python, no JAX: the simulator and the server run the same index.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
import time
from collections.abc import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class CacheEvent:
    """A change to one replica's prefix cache.

    seq: the replica's event number, 0, 1, 2, ... (a gap means events were lost);
    stored / removed: page hashes registered / evicted; cleared: the whole cache was dropped
    (applied before `stored`).
    """

    replica: int
    seq: int
    stored: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    cleared: bool = False


class PrefixIndex:
    """Page hash -> bitmask of the replicas that hold that page (confirmed by their events),
    plus speculative marks of where requests were just routed.

    A lookup reads one dict per page: `_holders` is kept equal to the confirmed mask OR
    the speculative one on every change (events and marks, off the lookup's path)."""

    def __init__(self, num_replicas: int, *, speculative_ttl_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not speculative_ttl_s >= 0:
            raise ValueError(f"speculative_ttl_s must be >= 0, got {speculative_ttl_s!r}")
        self.num_replicas = num_replicas
        self.speculative_ttl_s = speculative_ttl_s
        self._clock = clock
        self._confirmed: dict[bytes, int] = {}                # hash -> replica bitmask
        self._holders: dict[bytes, int] = {}                  # confirmed | speculative
        self._next_seq = [0] * num_replicas
        # Speculative marks: hash -> replica bitmask, held until the page's latest mark
        # expires (a page marked again for any replica keeps all its marks a while longer:
        # a bounded over-estimate that keeps the bookkeeping per page, not per mark).
        self._speculative: dict[bytes, int] = {}
        self._marked_until: dict[bytes, float] = {}
        self._expiries: collections.deque[tuple[float, tuple[bytes, ...]]] = collections.deque()
        self.num_gaps = 0                                     # events lost and recovered from

    # ----------------------------------------------------------------- events

    def apply(self, event: CacheEvent) -> bool:
        """Applies one replica's event. Returns False when events before it were lost: the
        replica's entries are then dropped (a stale index would send requests to pages
        that are gone) and rebuilt from this event on."""
        r = self._check_replica(event.replica)
        in_order = event.seq == self._next_seq[r]
        if not in_order:
            self.num_gaps += 1
            self.forget_replica(r)
        self._next_seq[r] = event.seq + 1
        bit = 1 << r
        if event.cleared:
            self._drop_confirmed(bit)
        confirmed = self._confirmed
        for h in event.removed:
            mask = confirmed.pop(h, 0) & ~bit
            if mask:
                confirmed[h] = mask
            self._refresh(h)
        for h in event.stored:
            confirmed[h] = confirmed.get(h, 0) | bit
            self._holders[h] = self._holders.get(h, 0) | bit
        return in_order

    def listener(self, replica: int) -> Callable[[Sequence[bytes], Sequence[bytes], bool], None]:
        """A callback for an in-process allocator (`BlockAllocator(on_cache_change=...)`):
        numbers its events itself, so none can be lost."""
        r = self._check_replica(replica)

        def on_cache_change(stored: Sequence[bytes], removed: Sequence[bytes],
                            cleared: bool = False) -> None:
            self.apply(CacheEvent(r, self._next_seq[r], tuple(stored), tuple(removed), cleared))
        return on_cache_change

    def forget_replica(self, replica: int) -> None:
        """Drops everything the index knows of a replica (it died, restarted or lost events)."""
        bit = 1 << self._check_replica(replica)
        self._drop_confirmed(bit)
        speculative = self._speculative
        for h in [h for h, mask in speculative.items() if mask & bit]:
            speculative[h] &= ~bit
            self._refresh(h)

    # ----------------------------------------------------------------- routing

    def mark_routed(self, replica: int, hashes: Sequence[bytes]) -> None:
        """The prompt with these page hashes (those not yet confirmed there are enough)
        was just sent to `replica`: count its pages as held there until the replica's events
        confirm them or the mark expires."""
        bit = 1 << self._check_replica(replica)
        if not hashes or self.speculative_ttl_s == 0:
            return
        expiry = self._clock() + self.speculative_ttl_s
        hashes = tuple(hashes)
        speculative, marked_until, holders = self._speculative, self._marked_until, self._holders
        for h in hashes:
            speculative[h] = speculative.get(h, 0) | bit
            holders[h] = holders.get(h, 0) | bit
            marked_until[h] = expiry
        self._expiries.append((expiry, hashes))

    def cached_pages(self, hashes: Sequence[bytes]) -> list[int]:
        """For each replica, how many leading pages of a prompt with these page hashes it
        holds (confirmed or speculatively). The replicas holding every page so far is a
        running AND over the pages' masks, taken in C (map, accumulate, groupby); Python
        steps only where that set shrinks, at most once per replica."""
        self._sweep()
        n = self.num_replicas
        counts = [0] * n
        held = (1 << n) - 1
        depth = 0
        running = itertools.accumulate(map(self._holders.get, hashes, itertools.repeat(0)),
                                       operator.and_, initial=held)
        next(running)
        for mask, run in itertools.groupby(running):
            dropped = held & ~mask
            while dropped:
                low = dropped & -dropped
                counts[low.bit_length() - 1] = depth
                dropped ^= low
            held = mask
            if not held:
                return counts
            depth += len(list(run))
        while held:
            low = held & -held
            counts[low.bit_length() - 1] = depth
            held ^= low
        return counts

    def num_pages_held(self, replica: int) -> int:
        """Confirmed pages of one replica (for metrics and tests)."""
        bit = 1 << self._check_replica(replica)
        return sum(1 for mask in self._confirmed.values() if mask & bit)

    # ----------------------------------------------------------------- internals

    def _refresh(self, h: bytes) -> None:
        """_holders[h] = confirmed | speculative, or no entry when both are empty."""
        mask = self._confirmed.get(h, 0) | self._speculative.get(h, 0)
        if mask:
            self._holders[h] = mask
        else:
            self._holders.pop(h, None)

    def _sweep(self) -> None:
        now = self._clock()
        expiries, speculative, marked_until = self._expiries, self._speculative, self._marked_until
        while expiries and expiries[0][0] <= now:
            _, hashes = expiries.popleft()
            for h in hashes:
                # A later mark of the same page keeps it.
                if marked_until.get(h, now + 1) <= now:
                    del marked_until[h], speculative[h]
                    self._refresh(h)

    def _drop_confirmed(self, bit: int) -> None:
        confirmed = self._confirmed
        for h in [h for h, mask in confirmed.items() if mask & bit]:
            mask = confirmed[h] & ~bit
            if mask:
                confirmed[h] = mask
            else:
                del confirmed[h]
            self._refresh(h)

    def _check_replica(self, replica: int) -> int:
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica {replica} is not in [0, {self.num_replicas})")
        return replica
