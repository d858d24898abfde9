"""Batches in flight: the controller's schedule() / update() around a pipelined executor.

`run_one_step` (controller.py) runs one batch at a time: the device waits while the host
applies a result and forms the next batch. `InFlightRunner` keeps up to
`executor.max_in_flight` batches dispatched (the spp stages of a pipelined engine, or two
on one program so that the host builds step n + 1 while the device runs step n) and
applies results oldest first, so updates arrive in the order batches were formed:

    step():  while there is room: schedule() -> executor.dispatch(batch)   (never waits)
             then: executor.collect(oldest) -> controller.update(oldest)   (waits for it)

An executor whose batches in flight are independent of each other (the switching
coordinator's units: each batch runs on its own devices, for its own requests) may say
which one to apply first: `first_done(handles)` waits until one of them has finished and
returns its position, so a fast unit's result is applied (and its next batch formed)
without waiting for a slower unit's. Each request's chunks still update in scheduling
order: a request is in one unit, which has one batch in flight.

The server loop and the simulator both drive a replica through it, so what the simulator
measures is what the server's controller does. A failure in dispatch or collect is raised
as `BatchFailed` naming the batch, which has left the pipe; the caller fails its requests.
"""

from __future__ import annotations

import collections
import dataclasses

from medha_jax.request import Batch, PipelinedExecutor, RequestUpdate, StepResult
from medha_jax.scheduler.controller import ReplicaController


class BatchFailed(Exception):
    """The executor failed on `batch` (dispatching or collecting it)."""

    def __init__(self, batch: Batch, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.batch, self.cause = batch, cause


@dataclasses.dataclass(frozen=True)
class Collected:
    """One batch that left the pipe: what ran, what it returned, what it changed."""

    batch: Batch
    result: StepResult
    updates: list[RequestUpdate]


class InFlightRunner:
    """Drives one controller and one pipelined executor with batches in flight."""

    def __init__(self, controller: ReplicaController, executor: PipelinedExecutor):
        if executor.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {executor.max_in_flight}")
        self.controller, self.executor = controller, executor
        self._pending: collections.deque[tuple[Batch, object]] = collections.deque()

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    @property
    def oldest(self) -> object | None:
        """The executor's handle of the oldest batch in flight (None when the pipe is empty)."""
        return self._pending[0][1] if self._pending else None

    @property
    def handles(self) -> list:
        """The executor's handles of the batches in flight, oldest first."""
        return [handle for _, handle in self._pending]

    def dispatch_next(self) -> Batch | None:
        """Forms and dispatches one batch if the pipe has room; None when it has no room
        or nothing can run now. Raises BatchFailed when the executor rejects it."""
        if len(self._pending) >= self.executor.max_in_flight:
            return None
        batch = self.controller.schedule()
        if not batch:
            return None
        try:
            pending = self.executor.dispatch(batch)
        except Exception as e:
            raise BatchFailed(batch, e) from e
        self._pending.append((batch, pending))
        return batch

    def collect_next(self) -> Collected:
        """Waits for the oldest batch in flight (or, where the executor orders them, the
        first done: `first_done`) and applies its result."""
        first_done = getattr(self.executor, "first_done", None)
        if first_done is not None and len(self._pending) > 1:
            i = first_done([handle for _, handle in self._pending])
            self._pending.rotate(-i)
            batch, pending = self._pending.popleft()
            self._pending.rotate(i)
        else:
            batch, pending = self._pending.popleft()
        try:
            result = self.executor.collect(pending)
            updates = self.controller.update(batch, result)
        except Exception as e:
            raise BatchFailed(batch, e) from e
        return Collected(batch, result, updates)

    def step(self) -> Collected | None:
        """Fills the pipe, then collects its oldest (or first done) batch. None when
        nothing is in flight (nothing could be scheduled)."""
        while self.dispatch_next() is not None:
            pass
        return self.collect_next() if self._pending else None

    def abandon(self) -> list[Batch]:
        """Drops every batch in flight unapplied (their results are lost: the cache they
        read was lost with a failed step); the caller preempts their requests
        (ReplicaController.preempt_all). Returns the dropped batches."""
        dropped = [batch for batch, _ in self._pending]
        self._pending.clear()
        return dropped

    def drain(self) -> list[Collected]:
        """Collects every batch in flight without dispatching more."""
        return [self.collect_next() for _ in range(len(self._pending))]
