"""ReplicaController: the request life cycle of one model replica.

Each `step()`:
  1. orders the prefill queue with the policy and asks the packer for a batch; while
     packing, the controller's gate registers KV pages for each chunk, preempting the
     lowest-priority running request when the cache is full (recompute preemption: the
     victim's pages are freed, it keeps its output and goes back to the queue; it is
     never dropped);
  2. runs the batch on the executor (the JAX engine, the simulator, a test double);
  3. applies the result: progress, prefix-cache commits, sampled tokens, finishes.
Plain Python, single-threaded: the server serialises calls from its own loop thread.

The KV allocator is medha_jax.kv_cache.allocator.BlockAllocator or anything with its
interface (the simulator counts pages without page ids).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Protocol

from medha_jax.request import (Batch, Clock, Executor, FinishReason, Request, RequestState,
                               RequestUpdate, ScheduledChunk, StepResult)
from medha_jax.scheduler.packer import BatchPacker
from medha_jax.scheduler.policies import Policy, PriorityIndex
from medha_jax.scheduler.prefill_time_cache import PrefillTimeCache


class CapacityError(ValueError):
    """RESOURCE: the request can never fit in this replica's KV cache."""


class KVAllocator(Protocol):
    """The part of medha_jax.kv_cache.allocator.BlockAllocator the controller uses."""

    page_size: int
    num_pages: int

    @property
    def num_free_pages(self) -> int: ...

    def pages_needed(self, num_tokens: int) -> int: ...

    def can_ever_fit(self, num_tokens: int) -> bool: ...

    def allocate(self, request_id: str, token_ids: Sequence[int] | None = None) -> int: ...

    def reserve(self, request_id: str, num_tokens: int) -> bool: ...

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed: int) -> None: ...

    def free(self, request_id: str) -> None: ...

    def has(self, request_id: str) -> bool: ...


class _TokenView(Sequence):
    """Prompt + output token ids of a request without copying them (for the allocator's hashes)."""

    def __init__(self, request: Request):
        self._request = request

    def __len__(self) -> int:
        return self._request.num_tokens

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError(f"token views support contiguous slices only, got step {step}")
            return self._request.token_ids(start, max(start, stop))
        if index < 0:
            index += len(self)
        return self._request.token_ids(index, index + 1)[0]


def _token_ids(request: Request) -> Sequence[int] | None:
    return _TokenView(request) if request.prompt_token_ids is not None else None


class ReplicaController:
    """Owns the waiting, running and finished requests of one replica."""

    def __init__(self, *, policy: Policy, packer: BatchPacker, executor: Executor,
                 allocator: KVAllocator, clock: Clock, prefill_time_cache: PrefillTimeCache,
                 max_model_len: int, eos_token_ids: Iterable[int] = (),
                 max_prefill_candidates: int = 64, name: str = "custom"):
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if max_prefill_candidates < 1:
            raise ValueError(f"max_prefill_candidates must be >= 1, got {max_prefill_candidates}")
        if prefill_time_cache.max_len < max_model_len:
            raise ValueError(f"the prefill time cache covers {prefill_time_cache.max_len} tokens, "
                             f"less than {max_model_len=}")
        self.name = name                            # the policy name it was made from
        self.policy, self.packer, self.executor = policy, packer, executor
        self.allocator, self.clock, self.prefill_time_cache = allocator, clock, prefill_time_cache
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        # How many of the most urgent prefills the packer looks at per iteration: a batch
        # never holds more than a few, and ordering only the top keeps a step cheap at
        # 10,000 queued requests.
        self.max_prefill_candidates = max_prefill_candidates

        self._requests: dict[str, Request] = {}     # unfinished
        self._running: dict[str, Request] = {}      # hold KV pages
        self._decodes: dict[str, Request] = {}      # running, one token to compute
        self._prefills = PriorityIndex(policy)      # waiting + running with prefill work left
        self._admission: dict[str, int] = {}        # request_id -> admission number (tie-break)
        # Tokens each running request's pages hold, mirrored from the allocator so that a
        # decode, which needs a new page only every page_size steps, skips the call.
        self._reserved_tokens: dict[str, int] = {}
        self._num_admitted = 0
        self.finished: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_steps = 0
        self.last_schedule_seconds = 0.0            # host time of the last batch formation

    # ------------------------------------------------------------------ queries

    @property
    def num_waiting(self) -> int:
        return len(self._requests) - len(self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id) or self.finished.get(request_id)

    def unfinished(self) -> list[Request]:
        return list(self._requests.values())

    def pop_finished(self) -> list[Request]:
        """The finished requests, forgotten by the controller (long-running servers)."""
        done = list(self.finished.values())
        self.finished.clear()
        return done

    def outstanding_work_s(self, decode_token_s: float) -> float:
        """Predicted seconds of work left: remaining prefills plus remaining decode tokens."""
        work = 0.0
        for r in self._requests.values():
            work += self.prefill_time_cache.remaining_work(r)
            work += (r.max_new_tokens - len(r.output_token_ids)) * decode_token_s
        return work

    # ------------------------------------------------------------ admission / exit

    def add_request(self, request: Request) -> None:
        """Admits a request or raises ValueError (CapacityError when it can never fit)."""
        rid = request.request_id
        if rid in self._requests or rid in self.finished:
            raise ValueError(f"request_id {rid!r} is already in use")
        if request.state is not RequestState.WAITING or request.num_computed_tokens or \
                request.output_token_ids:
            raise ValueError(f"request {rid!r} already has progress (state={request.state.value}, "
                             f"num_computed_tokens={request.num_computed_tokens}, "
                             f"{len(request.output_token_ids)} output tokens)")
        self.check_fits(request.prompt_len, request.max_new_tokens, request_id=rid)
        request.w_total = self.prefill_time_cache.prefill_time(request.prompt_len)
        self._requests[rid] = request
        self._admission[rid] = self._num_admitted
        self._num_admitted += 1
        self._prefills.add(request)

    def check_fits(self, prompt_len: int, max_new_tokens: int, *, request_id: str = "") -> None:
        """Raises when a request of this size can never run here: longer than max_model_len
        (ValueError) or more KV pages than the whole cache (CapacityError). Reads only fixed
        sizes, so a server may call it on the caller's thread before queueing the request."""
        name = f"request {request_id!r}: " if request_id else ""
        total = prompt_len + max_new_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"{name}prompt_len={prompt_len} + max_tokens={max_new_tokens} = {total} exceeds "
                f"max_model_len={self.max_model_len} (the model's context, capped by the KV cache)")
        cached_tokens = total - 1   # the last sampled token is never computed
        if not self.allocator.can_ever_fit(cached_tokens):
            raise CapacityError(
                f"RESOURCE: {name}needs {self.allocator.pages_needed(cached_tokens)} KV pages of "
                f"{self.allocator.page_size} tokens (prompt_len={prompt_len} + max_tokens="
                f"{max_new_tokens}) but the whole cache has {self.allocator.num_pages}")

    def cancel(self, request_id: str) -> bool:
        """Cancels an unfinished request and frees its pages; False if there is none."""
        return self.finish(request_id, FinishReason.CANCELLED)

    def finish(self, request_id: str, reason: FinishReason) -> bool:
        """Finishes an unfinished request now (stop strings, cancellation, errors)."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._finish(request, FinishReason(reason), self.clock.now())
        return True

    def _finish(self, request: Request, reason: FinishReason, now: float) -> None:
        rid = request.request_id
        if self.allocator.has(rid):
            self._free_pages(rid)
        if request in self._prefills:
            self._prefills.remove(request)
        self._decodes.pop(rid, None)
        self._running.pop(rid, None)
        del self._requests[rid]
        del self._admission[rid]
        request.state = RequestState.FINISHED
        request.finish_reason = reason
        request.finish_time = now
        self.finished[rid] = request

    # -------------------------------------------------------------------- steps

    def step(self) -> list[RequestUpdate]:
        """One iteration: form a batch, run it, apply the result."""
        start = time.perf_counter()
        batch = self._schedule()
        self.last_schedule_seconds = time.perf_counter() - start
        if not batch:
            return []
        result = self.executor.execute(batch)
        self.num_steps += 1
        return self._apply(batch, result)

    def _schedule(self) -> Batch:
        """Forms the next batch and reserves its KV pages (without running it)."""
        now = self.clock.now()
        candidates = self._prefills.top(now, self.max_prefill_candidates)
        gate = _KVGate(self, now)
        batch = self.packer.pack(self._decode_order(), candidates, now, gate)
        gate.release_unscheduled()
        return batch

    def _decode_order(self) -> list[Request]:
        decodes = list(self._decodes.values())
        if len(decodes) > self.packer.limits.max_seqs_per_batch:
            # More decodes than one step holds: they take turns, longest waiting first.
            decodes.sort(key=lambda r: r.last_token_time)
        return decodes

    def _apply(self, batch: Batch, result: StepResult) -> list[RequestUpdate]:
        now = self.clock.now()
        updates = []
        for chunk in batch.chunks:
            request = chunk.request
            rid = request.request_id
            samples = chunk.samples
            request.num_computed_tokens = chunk.end
            if request.prompt_token_ids is not None:
                self.allocator.commit(rid, _TokenView(request), chunk.end)
            if not samples:
                self._prefills.update(request)     # w(t) fell: its key moved
                continue
            try:
                token = int(result.sampled_token_ids[rid])
            except KeyError:
                raise RuntimeError(f"the executor returned no token for request {rid!r}, whose "
                                   f"chunk [{chunk.start}, {chunk.end}) samples") from None
            request.output_token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            reason = self._stop_reason(request, token)
            if reason is not None:
                self._finish(request, reason, now)
            elif rid not in self._decodes:
                self._prefills.remove(request)
                self._decodes[rid] = request
            updates.append(RequestUpdate(request, (token,), reason is not None))
        return updates

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        sampling = request.sampling
        if token in sampling.stop_token_ids or \
                (not sampling.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if len(request.output_token_ids) >= request.max_new_tokens:
            return FinishReason.LENGTH
        return None

    # ---------------------------------------------------------------- preemption

    def _preempt(self, request: Request) -> None:
        """Frees the request's pages; it keeps its output and is recomputed later."""
        rid = request.request_id
        self._free_pages(rid)
        del self._running[rid]
        request.state = RequestState.WAITING
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self._decodes.pop(rid, None) is not None:
            self._prefills.add(request)
        else:
            self._prefills.update(request)

    def _free_pages(self, request_id: str) -> None:
        self.allocator.free(request_id)
        self._reserved_tokens.pop(request_id, None)

    def _rank(self, request: Request, now: float) -> tuple[int, float, int]:
        """A strict order of urgency: the policy's, ties to the earlier admission.

        Strict, so that the most urgent request can always evict any other and the
        cache never deadlocks with every holder waiting for a page."""
        return (*self.policy.sort_key(request, now), self._admission[request.request_id])

    def _pick_victim(self, requester: Request, exclude: set[str], now: float) -> Request | None:
        """The lowest-priority running request outside the batch, if below the requester."""
        victim, victim_rank = None, self._rank(requester, now)
        for rid, r in self._running.items():
            if rid in exclude or r is requester:
                continue
            rank = self._rank(r, now)
            if rank > victim_rank:
                victim, victim_rank = r, rank
        return victim


class _KVGate:
    """The controller's side of packing: KV pages for each chunk the packer wants."""

    def __init__(self, controller: ReplicaController, now: float):
        self.controller = controller
        self.now = now
        self.in_batch: set[str] = set()
        self.preempted: set[str] = set()
        self.allocated: list[Request] = []    # waiting requests registered during packing

    def prepare(self, request: Request) -> bool:
        rid = request.request_id
        if rid in self.preempted:     # preempted for a more urgent chunk of this very batch
            return False
        allocator = self.controller.allocator
        if request.state is RequestState.WAITING and not allocator.has(rid):
            reused = allocator.allocate(rid, _token_ids(request))
            self.controller._reserved_tokens[rid] = reused
            request.num_computed_tokens = request.num_cached_tokens = reused
            self.allocated.append(request)
            if reused:
                self.controller._prefills.update(request)
        return True

    def reserve(self, chunk: ScheduledChunk) -> bool:
        c = self.controller
        request = chunk.request
        rid = request.request_id
        if rid in self.preempted:
            return False
        end = chunk.end
        if end > c._reserved_tokens.get(rid, 0):
            while not c.allocator.reserve(rid, end):
                victim = c._pick_victim(request, self.in_batch, self.now)
                if victim is None:
                    return False          # nothing less urgent to evict: this chunk waits
                c._preempt(victim)
                self.preempted.add(victim.request_id)
            c._reserved_tokens[rid] = c.allocator.pages_needed(end) * c.allocator.page_size
        self.in_batch.add(rid)
        if request.state is RequestState.WAITING:
            request.state = RequestState.RUNNING
            c._running[rid] = request
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.now
        return True

    def release_unscheduled(self) -> None:
        """Waiting requests registered for a chunk that missed the batch give their pages back."""
        c = self.controller
        for request in self.allocated:
            if request.state is RequestState.WAITING and c.allocator.has(request.request_id):
                c._free_pages(request.request_id)
                if request.num_computed_tokens:
                    request.num_computed_tokens = request.num_cached_tokens = 0
                    c._prefills.update(request)
