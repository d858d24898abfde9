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


@dataclasses.dataclass(eq=False)
class _Tail:
    """One speculative mark: the pages of a prompt a replica was just sent, from the first
    one it did not hold. Keyed in the index by its first page not yet confirmed
    (`hashes[start]`); the replica's events move that key along as they confirm pages."""

    bit: int
    hashes: tuple[bytes, ...]
    start: int
    expiry: float
    live: bool = True


class PrefixIndex:
    """Page hash -> bitmask of the replicas that hold that page (confirmed by their events),
    plus speculative marks of where requests were just routed.

    A mark is one record per routed prompt (`_Tail`), not one entry per page, so routing
    writes O(1) whatever the prompt's length: a lookup walks the confirmed pages and, where a
    replica's run of them stops, looks up the marks that start at that page (one dict read)
    and compares their pages with the prompt's in C (tuple equality). The marks' keys move
    off the path: a replica's event confirming a mark's first page re-keys it to the next."""

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
        self._next_seq = [0] * num_replicas
        self._tails: dict[bytes, list[_Tail]] = {}            # first unconfirmed page -> marks
        self._expiries: collections.deque[_Tail] = collections.deque()   # in expiry order
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
        tails = self._tails
        for h in event.stored:
            confirmed[h] = confirmed.get(h, 0) | bit
            if h in tails:
                self._confirm_tail_start(h, bit)
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
        for key in list(self._tails):
            for tail in [t for t in self._tails[key] if t.bit == bit]:
                self._unlink(key, tail)

    # ----------------------------------------------------------------- routing

    def mark_routed(self, replica: int, hashes: Sequence[bytes]) -> None:
        """The prompt with these page hashes (from the first one not held there) was just
        sent to `replica`: count its pages as held there until the replica's events confirm
        them or the mark expires."""
        bit = 1 << self._check_replica(replica)
        if not hashes or self.speculative_ttl_s == 0:
            return
        tail = _Tail(bit, tuple(hashes), 0, self._clock() + self.speculative_ttl_s)
        self._tails.setdefault(tail.hashes[0], []).append(tail)
        self._expiries.append(tail)

    def cached_pages(self, hashes: Sequence[bytes]) -> list[int]:
        """For each replica, how many leading pages of a prompt with these page hashes it
        holds (confirmed or speculatively). The replicas holding every confirmed page so far
        is a running AND over the pages' masks, taken in C (map, accumulate, groupby);
        Python steps only where that set shrinks, at most once per replica, and there reads
        the marks starting at that page."""
        self._sweep()
        n = self.num_replicas
        counts = [0] * n
        held = (1 << n) - 1
        depth = 0
        running = itertools.accumulate(map(self._confirmed.get, hashes, itertools.repeat(0)),
                                       operator.and_, initial=held)
        next(running)
        tails = self._tails
        if not isinstance(hashes, tuple):
            hashes = tuple(hashes)
        for mask, run in itertools.groupby(running):
            dropped = held & ~mask
            while dropped:
                low = dropped & -dropped
                r = low.bit_length() - 1
                counts[r] = depth if not tails else self._speculative_depth(hashes, depth, low)
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

    def _speculative_depth(self, hashes: tuple[bytes, ...], depth: int, bit: int) -> int:
        """How far a replica holds a prompt whose confirmed pages there stop at `depth`:
        marks starting at that page extend it as far as their pages equal the prompt's,
        then confirmed pages and marks again (the union of both, page by page)."""
        confirmed, tails, n = self._confirmed, self._tails, len(hashes)
        while depth < n:
            if confirmed.get(hashes[depth], 0) & bit:
                depth += 1
                continue
            best = self._tail_reach(hashes, depth, bit, depth)
            if best == depth:
                break
            # Marks starting inside what this one covers may reach further (an older mark
            # that began deeper, before a page in front of it was evicted): found in C.
            lo = depth + 1
            while lo < best:
                hi = best
                for k in itertools.compress(range(lo, hi), map(tails.__contains__,
                                                               hashes[lo:hi])):
                    best = self._tail_reach(hashes, k, bit, best)
                lo = hi
            depth = best
        return depth

    def _tail_reach(self, hashes: tuple[bytes, ...], k: int, bit: int, best: int) -> int:
        """max(best, how far the replica's marks starting at page k cover the prompt)."""
        for tail in self._tails.get(hashes[k], ()):
            if tail.bit == bit:
                best = max(best, k + _common_prefix(hashes, k, tail.hashes, tail.start))
        return best

    def _confirm_tail_start(self, h: bytes, bit: int) -> None:
        """The replica confirmed page `h`: its marks that start there start at the next page
        (dropped when none is left)."""
        confirmed = self._confirmed
        for tail in [t for t in self._tails[h] if t.bit == bit]:
            self._unlink(h, tail)
            start, hashes = tail.start + 1, tail.hashes
            while start < len(hashes) and confirmed.get(hashes[start], 0) & bit:
                start += 1                   # confirmed before this page (events reordered)
            if start < len(hashes):
                tail.start, tail.live = start, True
                self._tails.setdefault(hashes[start], []).append(tail)

    def _unlink(self, key: bytes, tail: _Tail) -> None:
        marks = self._tails[key]
        marks.remove(tail)
        if not marks:
            del self._tails[key]
        tail.live = False

    def _sweep(self) -> None:
        now = self._clock()
        expiries = self._expiries
        while expiries and expiries[0].expiry <= now:
            tail = expiries.popleft()
            if tail.live:
                self._unlink(tail.hashes[tail.start], tail)

    def _drop_confirmed(self, bit: int) -> None:
        confirmed = self._confirmed
        for h in [h for h, mask in confirmed.items() if mask & bit]:
            mask = confirmed[h] & ~bit
            if mask:
                confirmed[h] = mask
            else:
                del confirmed[h]

    def _check_replica(self, replica: int) -> int:
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica {replica} is not in [0, {self.num_replicas})")
        return replica


def _common_prefix(a: tuple, i: int, b: tuple, j: int) -> int:
    """Length of the longest common prefix of a[i:] and b[j:]: whole slices compared in C,
    halving on a mismatch."""
    lo, hi = 0, min(len(a) - i, len(b) - j)
    if a[i:i + hi] == b[j:j + hi]:
        return hi
    hi -= 1
    while lo < hi:                  # a[i:i+lo] == b[j:j+lo], and not at hi
        mid = (lo + hi + 1) // 2
        if a[i + lo:i + mid] == b[j + lo:j + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
