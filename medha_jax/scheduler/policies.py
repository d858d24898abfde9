"""Priority policies (who goes first) and the index that orders the prefill queue.

Every policy's urgency is linear in time: key(t) = offset - slope * t, lower first.

    FCFS  arrival a                                   (offset a,                 slope 0)
    EDF   deadline a + d                              (offset a + d,             slope 0)
    LRS   slack a + d - t - w(t)                      (offset a + d - w(t),      slope 1)
    LARS  relative slack (a + d - t - w(t)) / w_total (offset (a+d-w(t))/w_total, slope 1/w_total)
    SRPT  remaining work w(t)                         (offset w(t),              slope 0)

(seed 000, section 4.1). w(t) is the remaining prefill work, from the PrefillTimeCache
(Algorithm 3); w_total the work of the whole prompt, set when the request is admitted.
Offsets change only when a request makes progress, so `PriorityIndex` stores
(offset, slope) per request in numpy arrays, and since keys only fall as time goes on,
the last top() bounds the next one: a few vectorised passes over the queue and a sort of
about 2k candidates - no re-sorting of thousands of Python objects each iteration. The request's priority class
(`Request.priority`, lower = more important) comes before the key. The index may keep a
second policy's keys beside the first (the controller draws space-sharing riders from the
least remaining work, SRPT, of a queue that LARS orders).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from medha_jax.request import Request

_REQUEST_ID = operator.attrgetter("request_id")


class Policy:
    """Orders prefills: `priority_key(request, now)`, lower goes first."""

    name: str = "policy"
    # Whether every key's slope is 0 (the order does not change as time goes on): the
    # index then reads the stored offsets as the keys, without a pass over the queue.
    constant_keys: bool = False

    def linear_key(self, request: Request) -> tuple[float, float]:
        """(offset, slope) with priority_key(request, t) = offset - slope * t."""
        raise NotImplementedError

    def priority_key(self, request: Request, now: float) -> float:
        offset, slope = self.linear_key(request)
        return offset - slope * now

    def sort_key(self, request: Request, now: float) -> tuple[int, float]:
        """Priority class first, then the policy's key."""
        return request.priority, self.priority_key(request, now)

    def linear_key_from_start(self, request: Request) -> tuple[float, float]:
        """linear_key as if the request had made no progress (all its prefill work left).
        What eviction compares: it does not change as a request computes, so a request
        evicted for another can never evict it back (see ReplicaController._pick_victim)."""
        return self.linear_key(request)

    def sort_key_from_start(self, request: Request, now: float) -> tuple[int, float]:
        offset, slope = self.linear_key_from_start(request)
        return request.priority, offset - slope * now

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FCFS(Policy):
    """First come, first served: the oldest arrival first."""

    name = "fcfs"
    constant_keys = True

    def linear_key(self, request: Request) -> tuple[float, float]:
        return request.arrival_time, 0.0


class EDF(Policy):
    """Earliest deadline first: the earliest TTFT deadline a + d first."""

    name = "edf"
    constant_keys = True

    def linear_key(self, request: Request) -> tuple[float, float]:
        return request.deadline, 0.0


class _WorkPolicy(Policy):
    """A policy that needs the remaining prefill work w(t) of a request."""

    def __init__(self, remaining_work: Callable[[Request], float]):
        self.remaining_work = remaining_work

    def linear_key(self, request: Request) -> tuple[float, float]:
        return self.key_with_work(request, self.remaining_work(request))

    def linear_key_from_start(self, request: Request) -> tuple[float, float]:
        return self.key_with_work(request, request.w_total)

    def key_with_work(self, request: Request, work: float) -> tuple[float, float]:
        """(offset, slope) of the request with `work` seconds of prefill left."""
        raise NotImplementedError


class LRS(_WorkPolicy):
    """Least remaining slack: a + d - t - w(t), smallest first."""

    name = "lrs"

    def key_with_work(self, request: Request, work: float) -> tuple[float, float]:
        return request.deadline - work, 1.0


class LARS(_WorkPolicy):
    """Length-aware relative slack: rho = (a + d - t - w(t)) / w_total, smallest first."""

    name = "lars"

    def key_with_work(self, request: Request, work: float) -> tuple[float, float]:
        w_total = request.w_total
        if not w_total > 0:
            raise ValueError(f"request {request.request_id}: LARS needs w_total > 0, got "
                             f"{w_total!r}; the controller sets it at admission")
        return (request.deadline - work) / w_total, 1.0 / w_total


class SRPT(_WorkPolicy):
    """Shortest remaining prefill work w(t) first. Not a scheduling policy of its own: the
    controller's second order, where it looks for short requests to run beside a long one."""

    name = "srpt"
    constant_keys = True

    def key_with_work(self, request: Request, work: float) -> tuple[float, float]:
        return work, 0.0


class QueuedPrefill(NamedTuple):
    """A request queued with prefill work left, as LARS sees it at one time t (seconds):
    what a router needs to predict where a new prefill would fall in that queue
    (`medha_jax.cluster.router.lars_ttft_s`)."""

    work_s: float       # w(t): predicted prefill seconds left
    slack_s: float      # a + d - t - w(t): below 0 when it can no longer meet its deadline
    total_s: float      # w_total: LARS's key is slack_s / total_s
    prompt_len: int     # its prompt's tokens (IsLong of Medha's Algorithm 2)


class QueuedPrefills(Sequence[QueuedPrefill]):
    """A replica's prefill queue at one time `now`, a QueuedPrefill per request, in no
    particular order: what a serving loop publishes after every step for the router.

    Publishing is one copy of the queue's w(t) (`PriorityIndex.requests_and_offsets`)
    and of its list of requests, whatever its length; the tuples are built only when a
    reader iterates, once per publication, from the copied w(t) and the requests' arrival,
    SLO, w_total and prompt length, which do not change once a request is admitted (a
    tuple per request on every step cost the loop ~1 ms at 1,000 queued). `work_s` is
    their sum, and `capped_work_s` the router's sum of min(w, cap), without the tuples.
    Prefills published as tuples (`of`, `plus`: a loop's inbox, a polled replica's)
    follow the requests."""

    __slots__ = ("now", "work_s", "_work", "_requests", "_more", "_tuples")

    def __init__(self, now: float = 0.0, work: np.ndarray | None = None,
                 requests: Sequence[Request] = (), more: Sequence[QueuedPrefill] = ()):
        """work: [len(requests) + len(more)] each one's w(t) (None: `more`'s, with no
        requests); requests: those of the first len(requests) entries, w(t) at `now`."""
        more = tuple(more)
        if work is None:
            if requests:
                raise ValueError("QueuedPrefills: requests need their w(t) in `work`")
            work = np.fromiter((q.work_s for q in more), float, len(more))
        if len(work) != len(requests) + len(more):
            raise ValueError(f"QueuedPrefills: {len(work)} w(t) for {len(requests)} "
                             f"requests and {len(more)} more")
        self.now, self._work, self._requests, self._more = now, work, requests, more
        self.work_s = float(work.sum())     # the queue's prefill seconds
        self._tuples: tuple[QueuedPrefill, ...] | None = None if requests else more

    @classmethod
    def of(cls, prefills: Iterable[QueuedPrefill]) -> QueuedPrefills:
        return cls(more=tuple(prefills))

    def plus(self, more: Sequence[QueuedPrefill]) -> QueuedPrefills:
        """This queue and `more` after it."""
        if not more:
            return self
        work = np.concatenate([self._work, np.fromiter((q.work_s for q in more), float,
                                                        len(more))])
        return QueuedPrefills(self.now, work, self._requests, self._more + tuple(more))

    def capped_work_s(self, cap: float) -> float:
        """The sum over the queue of min(w(t), cap)."""
        return float(np.minimum(self._work, cap).sum())

    def _all(self) -> tuple[QueuedPrefill, ...]:
        if self._tuples is None:       # two readers at once build equal tuples: harmless
            now, new = self.now, tuple.__new__    # (a namedtuple's __new__ is Python)
            self._tuples = tuple([
                new(QueuedPrefill, (w, r.arrival_time + r.slo.ttft_s - now - w, r.w_total,
                                    r.prompt_len))
                for r, w in zip(self._requests, self._work.tolist())]) + self._more
        return self._tuples

    def __len__(self) -> int:
        return len(self._work)

    def __getitem__(self, i):
        return self._all()[i]

    def __iter__(self) -> Iterator[QueuedPrefill]:
        return iter(self._all())

    def __eq__(self, other) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return self._all() == tuple(other)
        return NotImplemented

    __hash__ = None

    def __reduce__(self):      # sent to another process as its tuples, not its requests
        return QueuedPrefills.of, (self._all(),)

    def __repr__(self) -> str:
        return f"QueuedPrefills({list(self)!r})"


class PriorityIndex:
    """The prefill queue: requests with prompt (or recompute) work left, ordered by a policy
    and, optionally, by a secondary policy too.

    add / remove / update are O(1). `top(now, k)` is a few O(n) numpy passes plus the sort
    of about 2k candidates: every key falls (or stays) as time goes on, so the 2k-th
    smallest key of the last call (its threshold) still bounds at least k keys next time,
    unless many of those requests left or made progress; then one partition of the whole
    queue finds a new threshold. The threshold only picks candidates: the k returned are
    exactly the first k of the full order (class, key, insertion), whatever `now` is.
    """

    def __init__(self, policy: Policy, capacity: int = 64, *, secondary: Policy | None = None):
        self.policy = policy
        self.secondary = secondary
        self._policies = (policy,) if secondary is None else (policy, secondary)
        self._requests: list[Request] = []
        self._slot: dict[str, int] = {}          # request_id -> row
        self._offset = np.empty((len(self._policies), capacity))   # [policy, row]
        self._slope = np.empty((len(self._policies), capacity))
        self._klass = np.empty(capacity, dtype=np.int64)
        self._order = np.empty(capacity, dtype=np.int64)   # insertion number: the tie-break
        self._next_order = 0
        self._class_counts: dict[int, int] = {}            # priority class -> queued requests
        # (policy, k) -> a key at or above the k smallest of the last single-class top() of
        # that size: a size of its own each, since the candidates ask for a few and then
        # more (a small one's threshold would send the next larger one to a full partition).
        self._threshold: dict[tuple[int, int], float] = {}
        # request_id -> the secondary policy's offset (its key where slopes are 0: SRPT's
        # w(t)), read by id without touching the arrays.
        self.secondary_offsets: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._slot

    def __iter__(self):
        """The queued requests, in no particular order."""
        return iter(self._requests)

    def add(self, request: Request) -> None:
        if request.request_id in self._slot:
            raise ValueError(f"request {request.request_id} is already queued")
        row = len(self._requests)
        if row == len(self._klass):
            self._grow()
        self._requests.append(request)
        self._slot[request.request_id] = row
        self._klass[row] = request.priority
        self._class_counts[request.priority] = self._class_counts.get(request.priority, 0) + 1
        self._order[row] = self._next_order
        self._next_order += 1
        self._set_keys(row, request)

    def update(self, request: Request) -> None:
        """Re-reads the request's keys after it made progress."""
        self._set_keys(self._slot[request.request_id], request)

    def _set_keys(self, row: int, request: Request) -> None:
        for i, policy in enumerate(self._policies):
            offset, slope = policy.linear_key(request)
            self._offset[i, row], self._slope[i, row] = offset, slope
        if self.secondary is not None:
            self.secondary_offsets[request.request_id] = offset

    def remove(self, request: Request) -> None:
        row = self._slot.pop(request.request_id)
        self.secondary_offsets.pop(request.request_id, None)
        klass = int(self._klass[row])
        self._class_counts[klass] -= 1
        if not self._class_counts[klass]:
            del self._class_counts[klass]
        last = len(self._requests) - 1
        if row != last:   # move the last row into the hole
            moved = self._requests[last]
            self._requests[row] = moved
            self._slot[moved.request_id] = row
            for array in (self._offset, self._slope, self._klass, self._order):
                array[..., row] = array[..., last]
        self._requests.pop()

    def requests_and_offsets(self, *, secondary: bool = False
                             ) -> tuple[list[Request], np.ndarray]:
        """The queued requests and each one's offset by the policy, or by the secondary
        one (SRPT's is the request's w(t)): copies, [rows] in the same order."""
        return list(self._requests), self._offset[int(secondary), :len(self._requests)].copy()

    def sort_key(self, request: Request, now: float) -> tuple[int, float]:
        """The policy's sort_key of a queued request, from the stored key (no w(t))."""
        row = self._slot[request.request_id]
        return int(self._klass[row]), float(self._offset[0, row] - self._slope[0, row] * now)

    def in_policy_order(self, requests: list[Request], now: float) -> list[Request]:
        """Queued `requests` ordered by the policy's sort_key from the stored keys (a stable
        sort: equal keys keep their order); `sort_key` for a whole list in one pass."""
        if len(requests) < 2:
            return list(requests)
        rows = list(map(self._slot.__getitem__, map(_REQUEST_ID, requests)))
        keys = (self._offset[0, rows] - self._slope[0, rows] * now).tolist()
        klass = self._klass[rows].tolist()
        by = sorted(range(len(requests)), key=lambda j: (klass[j], keys[j]))
        return list(map(requests.__getitem__, by))

    def top(self, now: float, k: int, *, secondary: bool = False) -> list[Request]:
        """The k most urgent requests at time `now`, most urgent first (by the secondary
        policy's keys if `secondary`): by priority class, then key, then insertion."""
        i = int(secondary)
        if secondary and self.secondary is None:
            raise ValueError("this index keeps no secondary policy")
        rows = self._top_rows(self._keys(i, now), k, i, self._class_counts)
        return list(map(self._requests.__getitem__, rows.tolist()))

    def candidates(self, now: float, k: int, riders: int = 0, *, spare: int = 0,
                   runnable: Callable[[Request], bool] | None = None) -> Candidates:
        """top(now, k), then up to `riders` more: the first of the secondary order among the
        rest, themselves in the policy's order (a stable sort: equal keys keep the secondary
        order). With `runnable`, requests it rejects are skipped in both; `spare` more of
        each order are read so that up to that many rejected leave k and `riders`.

        What top(k + spare), top(k + riders + spare, secondary=True) and in_policy_order
        of the riders give, ordered only as far as it is read (`Candidates`)."""
        if riders and self.secondary is None:
            raise ValueError("this index keeps no secondary policy")
        return Candidates(self, now, k, riders, spare, runnable)

    def _keys(self, i: int, now: float) -> np.ndarray:
        """Every queued request's key at `now` by policy i: [rows], a fresh array (later
        updates leave it as it is)."""
        n = len(self._requests)
        if self._policies[i].constant_keys:
            return self._offset[i, :n].copy()
        return self._offset[i, :n] - self._slope[i, :n] * now

    def _top_rows(self, keys: np.ndarray, k: int, i: int, class_counts: dict[int, int]
                  ) -> np.ndarray:
        """The rows of the k smallest (class, key, insertion) among the first len(keys)
        rows; keys: [rows] by policy i (whose threshold it reads and keeps); class_counts:
        queued requests per priority class among those rows."""
        if len(keys) == 0 or k <= 0:
            return np.empty(0, dtype=np.int64)
        if len(class_counts) > 1:
            return self._top_rows_by_class(keys, k, class_counts)
        rows, self._threshold[i, k] = _first_rows(keys, self._order[:len(keys)], k,
                                                  self._threshold.get((i, k)))
        return rows

    def _top_rows_by_class(self, keys: np.ndarray, k: int, class_counts: dict[int, int]
                           ) -> np.ndarray:
        """top()'s rows with several priority classes: every row of the more important
        classes that the first k reach, and the best of the class where they end."""
        n = len(keys)
        klass, order = self._klass[:n], self._order[:n]
        taken = 0
        for last in sorted(class_counts):
            if taken + class_counts[last] >= k:
                break
            taken += class_counts[last]
        else:
            return np.lexsort((order, keys, klass))      # fewer than k queued
        rows = np.flatnonzero(klass < last)
        in_last = np.flatnonzero(klass == last)
        best, _ = _first_rows(keys[in_last], order[in_last], k - taken, None)
        rows = np.concatenate((rows, in_last[best]))
        return rows[np.lexsort((order[rows], keys[rows], klass[rows]))]

    def _grow(self) -> None:
        size = 2 * len(self._klass)
        self._offset = np.pad(self._offset, ((0, 0), (0, size - self._offset.shape[1])))
        self._slope = np.pad(self._slope, ((0, 0), (0, size - self._slope.shape[1])))
        self._klass = np.resize(self._klass, size)
        self._order = np.resize(self._order, size)


class Candidates(Sequence[Request]):
    """The prefills the controller offers the packer (`PriorityIndex.candidates`), ordered
    only as far as it is read.

    The packer reads about one batch's worth (ten or so at 1,000 queued, against 64 + 16
    candidates), so the first half of the top is ordered first, the rest of the top and
    then the riders only when reading goes past them (a quarter first would be cheaper at
    1,000 queued but dearer at 10,000, where batches read more: callgrind).

    Each part is ordered by the keys as they stood when this was made: while packing,
    the gate moves keys (a prepared request's cached prefix, a preemption), and a later
    part ordered by the moved keys could repeat or skip a request of an earlier one. So
    the whole is what ordering everything at once would have given. Rows stay put while
    packing (the index only appends, and those rows are not read here); the priority
    classes' counts are kept as they were too.
    """

    def __init__(self, index: PriorityIndex, now: float, k: int, riders: int, spare: int,
                 runnable: Callable[[Request], bool] | None):
        keys = index._keys(0, now)
        # Snapshot now: the secondary keys a later part orders by may move in place.
        secondary_keys = index._keys(1, now) if riders and len(keys) > k + spare else None
        self._items: list[Request] = []
        # The parts' generator holds what it reads, not this object: holding it, the two
        # would form a cycle that only the garbage collector frees (every step's keys
        # arrays and candidates kept until its next pass).
        self._parts = _ordered_parts(index, keys, secondary_keys, dict(index._class_counts),
                                     k, riders, spare, runnable)

    def _read_part(self) -> bool:
        """Orders the next part; False when every part was read."""
        part = next(self._parts, None)
        if part is None:
            return False
        self._items += part
        return True

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(self)[i]
        if i < 0:
            i += len(self)
        items = self._items
        while i >= len(items) and self._read_part():
            pass
        return items[i]

    def __iter__(self) -> Iterator[Request]:
        i, items = 0, self._items
        while True:
            n = len(items)
            if i < n:
                # Delegating to a slice's iterator: one resumption per item, not a loop's
                # five lines (the packer reads the candidates twice, heads and riders).
                yield from items[i:n]
                i = n
            elif not self._read_part():
                return

    def __len__(self) -> int:
        while self._read_part():
            pass
        return len(self._items)


def _ordered_parts(index: PriorityIndex, keys: np.ndarray, secondary_keys: np.ndarray | None,
                   classes: dict[int, int], k: int, riders: int, spare: int,
                   runnable: Callable[[Request], bool] | None) -> Iterator[list[Request]]:
    """`Candidates`' parts, one after the other, each following the last: keys [rows] by
    the policy and secondary_keys by the secondary one, as they stood when the candidates
    were made; classes: the priority classes' counts then."""
    requests, n = index._requests, len(keys)
    rows: list[int] = []

    def unblocked(top: list[int]) -> list[int]:
        # What `runnable` said when this was made: it changes while packing only for
        # requests the packer read (a chunk granted puts one in flight), the earlier
        # parts' rows, which stay.
        if runnable is None:
            return top
        read = set(rows)
        return [j for j in top if j in read or runnable(requests[j])]

    for size in (-(-k // 2), k):         # half the top, then the whole top
        if n <= size + spare:
            size = k                  # every row is ranked: the whole top at once
        # The first `size` of the first size + spare: a prefix of the next part's.
        top = unblocked(index._top_rows(keys, size + spare, 0, classes).tolist())[:size]
        yield list(map(requests.__getitem__, top[len(rows):]))
        rows = top
        if size == k:
            break
    if not riders or n <= k + spare:
        return
    taken = set(rows)
    more = itertools.filterfalse(taken.__contains__, index._top_rows(
        secondary_keys, k + riders + spare, 1, classes).tolist())
    more = list(itertools.islice(unblocked(list(more)), riders))
    if len(more) > 1:
        at = np.array(more)    # one conversion, not one per fancy index
        more = at[np.lexsort((keys[at], index._klass[at]))].tolist()
    yield list(map(requests.__getitem__, more))


def _first_rows(keys: np.ndarray, order: np.ndarray, k: int, threshold: float | None
                ) -> tuple[np.ndarray, float]:
    """The rows of the k smallest (key, order), in that order, and the threshold for the
    next call: the 2k-th smallest key (rows whose key is at most it are the candidates).

    keys, order: [rows]. Exact whatever the threshold: when at least k keys are at most it,
    the k-th smallest key is too, so every row that can be among the first k is a candidate.
    """
    n = len(keys)
    want = min(2 * k, n)
    rows = None
    if threshold is not None:
        rows = (keys <= threshold).nonzero()[0]     # flatnonzero's wrappers cost a third
        if not k <= len(rows) <= 8 * want:
            rows = None
    if rows is None:
        if want < n:    # every row tied with the want-th smallest key, not just some
            rows = np.flatnonzero(keys <= keys[np.argpartition(keys, want - 1)[want - 1]])
        else:
            rows = np.arange(n)
    rows = rows[np.lexsort((order[rows], keys[rows]))]
    return rows[:k], float(keys[rows[min(want, len(rows)) - 1]])
