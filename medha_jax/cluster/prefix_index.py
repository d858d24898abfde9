"""Which replica holds which prefix: an exact index of the replicas' prefix-cache pages.

Every replica's `BlockAllocator` registers a full page under a hash that chains the whole
prefix before it (`medha_jax.kv_cache.allocator.prefix_page_hashes`), so a prompt's page
hashes name its prefixes exactly: the router hashes a prompt once and asks, for every
replica at once, how many of its leading pages that replica holds. The index is fed by the
allocators' cache events (`CacheEvent`: pages stored, pages removed, everything cleared),
numbered per replica so that a lost event is detected and the replica's entries dropped
until it resends its state (Dynamo's KV router does the same with its event stream).

A lookup need not read every page of the prompt. A replica's pages of one prompt are a
prefix of it (its pool evicts a parent after its children) except where a page is an
ORPHAN there (held, its parent page not: `BlockAllocator.orphan_hashes` says when that
happens), and an allocator's events name its orphans. For the replicas whose events do
and that hold no orphan of this prompt, the masks of the prompt's pages only lose replicas
page after page, so each one's depth is found by bisection, O(log pages) reads per
replica that drops out; the others are walked page by page.

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
    (applied before `stored`);
    orphaned / adopted: held pages whose parent page just stopped / started being held
    there (the allocator's `orphan_hashes`; an orphan removed needs no mention). None: the
    sender does not follow its orphans, so the index reads that replica's pages one by one
    until a cleared event restates its cache with them.
    """

    replica: int
    seq: int
    stored: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
    cleared: bool = False
    orphaned: tuple[bytes, ...] | None = None
    adopted: tuple[bytes, ...] = ()


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
    writes O(1) whatever the prompt's length: a lookup finds where each replica's run of
    confirmed pages stops (by bisection where its orphans are known, see the module doc)
    and there looks up the marks that start at that page (one dict read) and compares
    their pages with the prompt's in C (tuple equality). The marks' keys move off the
    path: a replica's event confirming a mark's first page re-keys it to the next."""

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
        self._orphans: dict[bytes, int] = {}                  # hash -> replicas it is one of
        # Replicas whose orphans the index knows (every event since the last restatement
        # named them): an empty replica has none.
        self._orphans_known = (1 << num_replicas) - 1
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
            self._drop_orphans(bit)
            if event.orphaned is not None:        # a restatement names every orphan
                self._orphans_known |= bit
        if event.orphaned is None and self._orphans_known & bit:
            self._drop_orphans(bit)
            self._orphans_known &= ~bit
        confirmed, orphans = self._confirmed, self._orphans
        for h in event.removed:
            mask = confirmed.pop(h, 0) & ~bit
            if mask:
                confirmed[h] = mask
            if h in orphans:
                self._clear_orphan(h, bit)
        tails = self._tails
        for h in event.stored:
            confirmed[h] = confirmed.get(h, 0) | bit
            if h in tails:
                self._confirm_tail_start(h, bit)
        if self._orphans_known & bit:
            for h in event.adopted:
                if h in orphans:
                    self._clear_orphan(h, bit)
            for h in event.orphaned:
                orphans[h] = orphans.get(h, 0) | bit
        return in_order

    def listener(self, replica: int) -> Callable[..., None]:
        """A callback for an in-process allocator (`BlockAllocator(on_cache_change=...)`):
        numbers its events itself, so none can be lost."""
        r = self._check_replica(replica)

        def on_cache_change(stored: Sequence[bytes], removed: Sequence[bytes],
                            cleared: bool = False, orphaned: Sequence[bytes] | None = None,
                            adopted: Sequence[bytes] = ()) -> None:
            self.apply(CacheEvent(r, self._next_seq[r], tuple(stored), tuple(removed), cleared,
                                  None if orphaned is None else tuple(orphaned),
                                  tuple(adopted)))
        return on_cache_change

    def forget_replica(self, replica: int) -> None:
        """Drops everything the index knows of a replica (it died, restarted or lost
        events); its orphans are unknown until an event restates its cache."""
        bit = 1 << self._check_replica(replica)
        self._drop_confirmed(bit)
        self._drop_orphans(bit)
        self._orphans_known &= ~bit
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
        holds (confirmed or speculatively): where its confirmed pages stop (bisection for
        the replicas without orphans in this prompt, a walk for the others), extended by the
        marks that start there."""
        self._sweep()
        if not isinstance(hashes, tuple):
            hashes = tuple(hashes)
        counts = [0] * self.num_replicas
        closed = self._orphans_known
        orphans = self._orphans
        if orphans and closed:
            for h in filter(orphans.__contains__, hashes):
                closed &= ~orphans[h]
        if closed:
            self._bisect(hashes, closed, counts)
        walked = ((1 << self.num_replicas) - 1) & ~closed
        if walked:
            self._walk(hashes, walked, counts)
        tails = self._tails
        if tails:
            # The replicas with a mark starting where their confirmed pages stop.
            marked: dict[int, int] = {}
            for depth in set(counts):
                for tail in tails.get(hashes[depth], ()) if depth < len(hashes) else ():
                    marked[depth] = marked.get(depth, 0) | tail.bit
            if marked:
                for r, depth in enumerate(counts):
                    if marked.get(depth, 0) >> r & 1:
                        counts[r] = self._speculative_depth(hashes, depth, 1 << r)
        return counts

    def num_pages_held(self, replica: int) -> int:
        """Confirmed pages of one replica (for metrics and tests)."""
        bit = 1 << self._check_replica(replica)
        return sum(1 for mask in self._confirmed.values() if mask & bit)

    # ----------------------------------------------------------------- internals

    def _bisect(self, hashes: tuple[bytes, ...], replicas: int, counts: list[int]) -> None:
        """counts[r] = leading confirmed pages of r, for the replicas in the `replicas` mask,
        whose confirmed pages of this prompt are a prefix of it: the mask of page k,
        restricted to them, only loses replicas as k grows, so the pages where it changes
        are found by bisection (about log2(pages) reads per change)."""
        get = self._confirmed.get
        # (lo, hi, mask at lo, mask at hi): page -1 is held by all, page len(hashes) by none.
        stack = [(-1, len(hashes), replicas, 0)]
        while stack:
            lo, hi, at_lo, at_hi = stack.pop()
            if at_lo == at_hi:
                continue
            if hi - lo == 1:
                dropped = at_lo & ~at_hi
                while dropped:
                    low = dropped & -dropped
                    counts[low.bit_length() - 1] = hi
                    dropped ^= low
                continue
            mid = (lo + hi) // 2
            at_mid = get(hashes[mid], 0) & replicas
            stack.append((mid, hi, at_mid, at_hi))
            stack.append((lo, mid, at_lo, at_mid))

    def _walk(self, hashes: tuple[bytes, ...], replicas: int, counts: list[int]) -> None:
        """counts[r] = leading confirmed pages of r, for the replicas in the `replicas` mask,
        page by page: the replicas holding every page so far is a running AND over the
        pages' masks, taken in C (map, accumulate, groupby); Python steps only where that
        set shrinks, at most once per replica."""
        held = replicas
        depth = 0
        running = itertools.accumulate(map(self._confirmed.get, hashes, itertools.repeat(0)),
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
                return
            depth += len(list(run))
        while held:
            low = held & -held
            counts[low.bit_length() - 1] = depth
            held ^= low

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

    def _clear_orphan(self, h: bytes, bit: int) -> None:
        mask = self._orphans[h] & ~bit
        if mask:
            self._orphans[h] = mask
        else:
            del self._orphans[h]

    def _drop_orphans(self, bit: int) -> None:
        for h in [h for h, mask in self._orphans.items() if mask & bit]:
            self._clear_orphan(h, bit)

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
