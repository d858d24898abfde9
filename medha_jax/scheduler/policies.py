"""Priority policies (who goes first) and the index that orders the prefill queue.

Every policy's urgency is linear in time: key(t) = offset - slope * t, lower first.

    FCFS  arrival a                                   (offset a,                 slope 0)
    EDF   deadline a + d                              (offset a + d,             slope 0)
    LRS   slack a + d - t - w(t)                      (offset a + d - w(t),      slope 1)
    LARS  relative slack (a + d - t - w(t)) / w_total (offset (a+d-w(t))/w_total, slope 1/w_total)

(seed 000, section 4.1). w(t) is the remaining prefill work, from the PrefillTimeCache
(Algorithm 3); w_total the work of the whole prompt, set when the request is admitted.
Offsets change only when a request makes progress, so `PriorityIndex` stores
(offset, slope) per request in numpy arrays and orders the whole queue at time t with
one vectorised expression and a partial sort of the top few - no re-sorting of
thousands of Python objects each iteration. The request's priority class
(`Request.priority`, lower = more important) comes before the key.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from medha_jax.request import Request


class Policy:
    """Orders prefills: `priority_key(request, now)`, lower goes first."""

    name: str = "policy"

    def linear_key(self, request: Request) -> tuple[float, float]:
        """(offset, slope) with priority_key(request, t) = offset - slope * t."""
        raise NotImplementedError

    def priority_key(self, request: Request, now: float) -> float:
        offset, slope = self.linear_key(request)
        return offset - slope * now

    def sort_key(self, request: Request, now: float) -> tuple[int, float]:
        """Priority class first, then the policy's key."""
        return request.priority, self.priority_key(request, now)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FCFS(Policy):
    """First come, first served: the oldest arrival first."""

    name = "fcfs"

    def linear_key(self, request: Request) -> tuple[float, float]:
        return request.arrival_time, 0.0


class EDF(Policy):
    """Earliest deadline first: the earliest TTFT deadline a + d first."""

    name = "edf"

    def linear_key(self, request: Request) -> tuple[float, float]:
        return request.deadline, 0.0


class _SlackPolicy(Policy):
    """A policy that needs the remaining prefill work w(t) of a request."""

    def __init__(self, remaining_work: Callable[[Request], float]):
        self.remaining_work = remaining_work


class LRS(_SlackPolicy):
    """Least remaining slack: a + d - t - w(t), smallest first."""

    name = "lrs"

    def linear_key(self, request: Request) -> tuple[float, float]:
        return request.deadline - self.remaining_work(request), 1.0


class LARS(_SlackPolicy):
    """Length-aware relative slack: rho = (a + d - t - w(t)) / w_total, smallest first."""

    name = "lars"

    def linear_key(self, request: Request) -> tuple[float, float]:
        w_total = request.w_total
        if not w_total > 0:
            raise ValueError(f"request {request.request_id}: LARS needs w_total > 0, got "
                             f"{w_total!r}; the controller sets it at admission")
        return (request.deadline - self.remaining_work(request)) / w_total, 1.0 / w_total


class PriorityIndex:
    """The prefill queue: requests with prompt (or recompute) work left, ordered by a policy.

    add / remove / update are O(1); `top(now, k)` is O(n) numpy work plus O(k log k).
    """

    def __init__(self, policy: Policy, capacity: int = 64):
        self.policy = policy
        self._requests: list[Request] = []
        self._slot: dict[str, int] = {}          # request_id -> row
        self._offset = np.empty(capacity)
        self._slope = np.empty(capacity)
        self._klass = np.empty(capacity, dtype=np.int64)
        self._order = np.empty(capacity, dtype=np.int64)   # insertion number: the tie-break
        self._next_order = 0
        self._class_counts: dict[int, int] = {}            # priority class -> queued requests

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._slot

    def add(self, request: Request) -> None:
        if request.request_id in self._slot:
            raise ValueError(f"request {request.request_id} is already queued")
        row = len(self._requests)
        if row == len(self._offset):
            self._grow()
        self._requests.append(request)
        self._slot[request.request_id] = row
        self._klass[row] = request.priority
        self._class_counts[request.priority] = self._class_counts.get(request.priority, 0) + 1
        self._order[row] = self._next_order
        self._next_order += 1
        self._offset[row], self._slope[row] = self.policy.linear_key(request)

    def update(self, request: Request) -> None:
        """Re-reads the request's key after it made progress."""
        row = self._slot[request.request_id]
        self._offset[row], self._slope[row] = self.policy.linear_key(request)

    def remove(self, request: Request) -> None:
        row = self._slot.pop(request.request_id)
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
                array[row] = array[last]
        self._requests.pop()

    def top(self, now: float, k: int) -> list[Request]:
        """The k most urgent requests at time `now`, most urgent first."""
        n = len(self._requests)
        if n == 0 or k <= 0:
            return []
        keys = self._offset[:n] - self._slope[:n] * now
        if len(self._class_counts) > 1:
            # Several priority classes: a more important class always goes first, so
            # push every other class behind it by the spread of the keys.
            klass = self._klass[:n]
            spread = float(keys.max() - keys.min()) + 1.0
            keys += (klass - min(self._class_counts)) * spread
        rows = np.argpartition(keys, k - 1)[:k] if n > k else np.arange(n)
        rows = rows[np.lexsort((self._order[rows], keys[rows]))]   # by key, then arrival
        requests = self._requests
        return [requests[r] for r in rows.tolist()]

    def _grow(self) -> None:
        size = 2 * len(self._offset)
        self._offset = np.resize(self._offset, size)
        self._slope = np.resize(self._slope, size)
        self._klass = np.resize(self._klass, size)
        self._order = np.resize(self._order, size)
