"""ReplicaController: the request life cycle of one model replica.

Two public steps, as vLLM v1's scheduler (`schedule()` / `update_from_output()`):
  schedule() orders the prefill queue with the policy and asks the packer for a batch;
      while packing, the KV gate books pages for each chunk; when the cache is full it
      preempts the lowest-priority running request holding pages where they are missing
      (on that KV shard, under kvp) (recompute preemption: the victim's pages are freed,
      it keeps its output and goes back to the queue; it is never dropped).
  update(batch, result) applies what an executor returned for that batch: progress,
      prefix-cache commits, sampled tokens, finishes.
Execution is owned outside (the server loop, the simulator, tests, a pipelined engine).
Several batches may be in flight: update() may come after later schedule() calls, in any
order across requests but in scheduling order for each request's chunks. A request in an unfinished batch
is never preempted (its pages are being written). Its prefill may go on: the next chunk
starts where the scheduled ones end (`num_scheduled_tokens`), since it needs only their
K/V, which a pipelined executor writes in dispatch order (seed 000 section 3.3: chunk i+1
enters stage 0 while chunk i is in stage 1). A decode waits for its request's batch in
flight: it needs that batch's sampled token. `run_one_step` is the
synchronous schedule -> execute -> update iteration; `InFlightRunner`
(medha_jax.scheduler.in_flight) keeps several batches in flight.

Plain Python, single-threaded: the server serialises calls from its own loop thread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from medha_jax.request import (Batch, Clock, Executor, FinishReason, Request, RequestState,
                               RequestUpdate, ScheduledChunk, StepResult)
from medha_jax.scheduler.kv_reservations import KVAllocator, KVReservations
from medha_jax.scheduler.packer import BatchPacker
from medha_jax.scheduler.policies import SRPT, Policy, PriorityIndex, QueuedPrefills
from medha_jax.scheduler.prefill_time_cache import PrefillTimeCache

_new_tuple = tuple.__new__      # a NamedTuple's own __new__ is Python: per chunk, this is not
# Read per chunk, so bound once: on Python 3.11, `RequestState.WAITING` goes through
# EnumType.__getattr__'s slow attribute hook (a bound method-wrapper allocated per read;
# gone in 3.12).
_WAITING, _RUNNING = RequestState.WAITING, RequestState.RUNNING

__all__ = ["CapacityError", "KVAllocator", "ReplicaController", "run_one_step"]


class CapacityError(ValueError):
    """RESOURCE: the request can never fit in this replica's KV cache."""


def run_one_step(controller: ReplicaController, executor: Executor) -> list[RequestUpdate]:
    """One synchronous iteration: schedule a batch, execute it, apply the result.

    Returns [] when nothing could be scheduled. When `executor.execute` raises, the batch
    stays in flight; the caller finishes its requests (the server fails them)."""
    batch = controller.schedule()
    if not batch:
        return []
    return controller.update(batch, executor.execute(batch))


class ReplicaController:
    """Owns the waiting, running and finished requests of one replica."""

    def __init__(self, *, policy: Policy, packer: BatchPacker, allocator: KVAllocator,
                 clock: Clock, prefill_time_cache: PrefillTimeCache, max_model_len: int,
                 eos_token_ids: Iterable[int] = (), max_prefill_candidates: int = 64,
                 max_rider_candidates: int = 0, name: str = "custom"):
        """max_prefill_candidates: the most urgent prefills the packer is offered.
        max_rider_candidates: and up to this many more, of least remaining work among the
          rest (space sharing's riders; SchedulerConfig says why)."""
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if max_prefill_candidates < 1:
            raise ValueError(f"max_prefill_candidates must be >= 1, got {max_prefill_candidates}")
        if max_rider_candidates < 0:
            raise ValueError(f"max_rider_candidates must be >= 0, got {max_rider_candidates}")
        if prefill_time_cache.max_len < max_model_len:
            raise ValueError(f"the prefill time cache covers {prefill_time_cache.max_len} tokens, "
                             f"less than {max_model_len=}")
        self.name = name                            # the policy name it was made from
        self.policy, self.packer = policy, packer
        self.allocator, self.clock, self.prefill_time_cache = allocator, clock, prefill_time_cache
        self.kv = KVReservations(allocator)
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_prefill_candidates = max_prefill_candidates
        self.max_rider_candidates = max_rider_candidates

        self._requests: dict[str, Request] = {}     # unfinished
        self._decoders: dict[str, Request] = {}     # of those, the ones with max_tokens > 1
        self._running: dict[str, Request] = {}      # hold KV pages
        self._decodes: dict[str, Request] = {}      # running, one token to compute
        # slo.tpot_s -> how many of _decodes ask for it: the tightest without a pass.
        self._decode_tpots: dict[float, int] = {}
        # Unfinished requests with a per-token objective (a finite tpot_s): while there are
        # none, nothing bounds a batch's time (`AdaptivePacker.t_target`).
        self._num_paced = 0
        # Waiting + running with prefill work left; with riders also by remaining work.
        self._prefills = PriorityIndex(policy, secondary=SRPT(
            prefill_time_cache.remaining_work) if max_rider_candidates else None)
        self._admission: dict[str, int] = {}        # request_id -> admission number (tie-break)
        self._in_flight: dict[str, int] = {}        # request_id -> its batches not yet update()d
        self._num_admitted = 0
        self.finished: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_steps = 0                          # batches update()d
        self.last_schedule_seconds = 0.0            # host time of the last batch formation
        # Over the unfinished requests: max_new_tokens less the tokens generated, kept as
        # they come, generate and go (`decode_tokens_left`: no pass over them).
        self._decode_tokens_left = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_waiting(self) -> int:
        return len(self._requests) - len(self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_in_flight(self) -> int:
        """Requests in a batch that schedule() formed and update() has not yet applied."""
        return len(self._in_flight)

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

    @property
    def decode_tokens_left(self) -> int:
        """Every decode token the unfinished requests may still ask for: their max_tokens,
        less what they generated (kept as requests come, generate and go: no pass)."""
        return self._decode_tokens_left

    def queued_prefills(self) -> QueuedPrefills:
        """Each request here with prefill work left, as LARS sees it now (its w(t), slack
        and w_total): where a new prefill would fall in this queue (the router's
        predicted TTFT).

        A server publishes this every step: where the index keeps every queued prefill's
        w(t) as its SRPT key (lars-mp) it is one copy of those keys, whatever the queue's
        length (computing w(t) is a pass over the queue: about 900 us at 1,000 queued)."""
        if self.max_rider_candidates:
            requests, work = self._prefills.requests_and_offsets(secondary=True)
        else:
            requests = list(self._prefills)
            work = np.fromiter(map(self.prefill_time_cache.remaining_work, requests), float,
                               len(requests))
        return QueuedPrefills(self.clock.now(), work, requests)

    def decoding_requests(self) -> list[Request]:
        """Each unfinished request that decodes (max_tokens > 1), in no particular order:
        the decode batch a request joining here would share (a copy of a list kept as
        requests come and go: no pass over them)."""
        return list(self._decoders.values())

    # ------------------------------------------------------------ admission / exit

    def add_request(self, request: Request, *, resume: bool = False,
                    kv_from: tuple[str, int] | None = None) -> None:
        """Admits a request or raises ValueError (CapacityError when it can never fit).
        resume: it is re-run here after the replica serving it failed: it brings the output
        it had generated, recomputed with its prompt as after a preemption.
        kv_from: (owner, tokens): the allocator's pages held under `owner` hold the K/V of
        the request's first `tokens` tokens (a KV hand-off wrote them, serving.kv_transfer):
        it takes them and computes from there; an owner the allocator no longer holds is
        ignored (its pages went back: the request is computed as without it). When the
        request is refused, the owner's pages are freed."""
        rid = request.request_id
        owner, kv_tokens = kv_from if kv_from is not None else (None, 0)
        if owner is not None and not self.kv.allocator.has(owner):
            owner = None
        try:
            if rid in self._requests or rid in self.finished:
                raise ValueError(f"request_id {rid!r} is already in use")
            if request.state is not RequestState.WAITING or request.num_computed_tokens or \
                    (request.output_token_ids and not resume):
                raise ValueError(
                    f"request {rid!r} already has progress (state={request.state.value}, "
                    f"num_computed_tokens={request.num_computed_tokens}, "
                    f"{len(request.output_token_ids)} output tokens)")
            if not 0 <= kv_tokens < request.num_tokens:
                raise ValueError(f"request {rid!r}: kv_from holds {kv_tokens} tokens; at least "
                                 f"one of its {request.num_tokens} must be left to compute")
            self.check_fits(request.prompt_len, request.max_new_tokens, request_id=rid)
        except Exception:
            if owner is not None:
                self.kv.allocator.free(owner)
            raise
        if owner is not None:
            self.kv.adopt(request, owner)
            request.num_computed_tokens = request.num_cached_tokens = kv_tokens
        request.w_total = self.prefill_time_cache.prefill_time(request.prompt_len)
        self._requests[rid] = request
        if request.max_new_tokens > 1:
            self._decoders[rid] = request
        self._admission[rid] = self._num_admitted
        self._num_admitted += 1
        self._decode_tokens_left += request.max_new_tokens - len(request.output_token_ids)
        self._num_paced += math.isfinite(request.slo.tpot_s)
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
        self.kv.release(rid)
        self._in_flight.pop(rid, None)
        request.num_in_flight_tokens = 0
        if request in self._prefills:
            self._prefills.remove(request)
        self._drop_decode(request)
        self._running.pop(rid, None)
        del self._requests[rid]
        self._decoders.pop(rid, None)
        del self._admission[rid]
        self._decode_tokens_left -= request.max_new_tokens - len(request.output_token_ids)
        self._num_paced -= math.isfinite(request.slo.tpot_s)
        request.state = RequestState.FINISHED
        request.finish_reason = reason
        request.finish_time = now
        self.finished[rid] = request

    def preempt_all(self) -> int:
        """After the KV cache's contents were lost (a step failed on the device and the
        engine rebuilt the cache): every request holding pages is preempted for recompute
        from its tokens (it keeps its output), and the prefix cache, whose pages pointed
        into the lost cache, is dropped. Batches still in flight read the lost cache too:
        finish their requests (or drop those batches unapplied) first; any left are
        preempted here and their batches must not be update()d. Returns how many requests
        were preempted."""
        running = list(self._running.values())
        self._in_flight.clear()
        for request in self._requests.values():
            request.num_in_flight_tokens = 0
        for request in running:
            self._preempt(request)
        for request in self._requests.values():
            # Registered during packing but not yet running: its pages are gone too.
            if self.kv.has(request.request_id):
                self.kv.release(request.request_id)
                request.num_computed_tokens = request.num_cached_tokens = 0
                self._prefills.update(request)
        self.kv.drop_prefix_cache()
        return len(running)

    # -------------------------------------------------------------------- steps

    def schedule(self) -> Batch:
        """Forms the next batch and books its KV pages; its requests are then in flight
        until update(batch, ...). An empty batch when nothing can run now."""
        start = time.perf_counter()
        now = self.clock.now()
        candidates = self._candidates(now)
        # The gate marks each chunk in flight as it grants its pages (every granted chunk
        # joins the batch), in the same loop that books them.
        gate = _KVGate(self.kv, now, in_flight=self._in_flight, running=self._running,
                       pick_victim=self._pick_victim, preempt=self._preempt,
                       requeue=self._prefills.update)
        decodes = self._decode_order()
        batch = self.packer.pack(
            decodes, candidates, now, gate,
            tightest_tpot=min(self._decode_tpots) if decodes and len(decodes) == len(
                self._decodes) else None,
            # With riders, the index keeps every queued prefill's w(t) as its SRPT key.
            queued_work=self._prefills.secondary_offsets.__getitem__
            if self.max_rider_candidates else None,
            paced=self._num_paced > 0)
        gate.release_unscheduled()
        self.last_schedule_seconds = time.perf_counter() - start
        return batch

    def update(self, batch: Batch, result: StepResult) -> list[RequestUpdate]:
        """Applies an executed batch formed by schedule(), in any order relative to later
        schedule() calls. Chunks of requests finished meanwhile (cancelled) are dropped."""
        live = []
        for chunk in batch.chunks:
            request, rid = chunk.request, chunk.request.request_id
            if self._requests.get(rid) is not request:
                continue                            # finished while its batch ran
            if rid not in self._in_flight or chunk.start != request.num_computed_tokens:
                raise ValueError(
                    f"request {rid!r}: chunk [{chunk.start}, {chunk.end}) is not in flight "
                    f"(num_computed_tokens={request.num_computed_tokens}); update each batch "
                    f"from schedule() exactly once")
            if chunk.samples and rid not in result.sampled_token_ids:
                raise RuntimeError(f"the executor returned no token for request {rid!r}, whose "
                                   f"chunk [{chunk.start}, {chunk.end}) samples")
            live.append(chunk)
        self.num_steps += 1
        now = self.clock.now()
        updates = []
        for chunk in live:
            request = chunk.request
            rid = request.request_id
            if self._in_flight[rid] == 1:
                del self._in_flight[rid]
            else:
                self._in_flight[rid] -= 1
            request.num_in_flight_tokens -= chunk.num_tokens
            request.num_computed_tokens = chunk.end
            self.kv.commit(request, chunk.end)
            if not chunk.samples:
                self._prefills.update(request)     # w(t) fell: its key moved
                continue
            token = int(result.sampled_token_ids[rid])
            request.output_token_ids.append(token)
            self._decode_tokens_left -= 1
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            reason = self._stop_reason(request, token)
            if reason is not None:
                self._finish(request, reason, now)
            elif rid not in self._decodes:
                self._prefills.remove(request)
                self._decodes[rid] = request
                tpot = request.slo.tpot_s
                self._decode_tpots[tpot] = self._decode_tpots.get(tpot, 0) + 1
            updates.append(RequestUpdate(request, (token,), reason is not None))
        return updates

    def _candidates(self, now: float) -> Sequence[Request]:
        """The prefills the packer is offered, in policy order: the max_prefill_candidates
        most urgent, then up to max_rider_candidates of least remaining work among the rest
        (ordered only as far as the packer reads them: `Candidates`).

        The packer reads only a few, so only the top is ordered. But space sharing runs a
        short request beside a long one as soon as it arrives, when the policy (LARS: its
        relative slack is high) ranks it last: beyond the top whenever more prefills are
        queued, as in a burst. Least remaining work is who most likely fits the long
        one's slack. Those come after the top, so the list stays a subsequence of the
        policy's order and the packer's reading of it holds."""
        in_flight = self._in_flight
        if not in_flight:
            return self._prefills.candidates(now, self.max_prefill_candidates,
                                             self.max_rider_candidates)

        def runnable(r: Request) -> bool:
            # A request in flight may get its next prefill chunk, never a second sample.
            return r.request_id not in in_flight or r.num_scheduled_tokens < r.num_tokens

        return self._prefills.candidates(now, self.max_prefill_candidates,
                                         self.max_rider_candidates, spare=len(in_flight),
                                         runnable=runnable)

    def _decode_order(self) -> list[Request]:
        decodes = list(self._decodes.values())
        if self._in_flight:
            decodes = [r for r in decodes if r.request_id not in self._in_flight]
        if len(decodes) > self.packer.limits.max_seqs_per_batch:
            # More decodes than one step holds: they take turns, longest waiting first.
            decodes.sort(key=lambda r: r.last_token_time)
        return decodes

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        sampling = request.sampling
        if token in sampling.stop_token_ids or \
                (not sampling.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if len(request.output_token_ids) >= request.max_new_tokens:
            return FinishReason.LENGTH
        return None

    # ----------------------------------------------------- the KV gate's callbacks

    def _preempt(self, request: Request) -> None:
        """Frees the request's pages; it keeps its output and is recomputed later."""
        rid = request.request_id
        self.kv.release(rid)
        del self._running[rid]
        request.state = RequestState.WAITING
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        if self._drop_decode(request):
            self._prefills.add(request)
        else:
            self._prefills.update(request)

    def _drop_decode(self, request: Request) -> bool:
        """Takes the request out of the decodes; whether it was one."""
        if self._decodes.pop(request.request_id, None) is None:
            return False
        tpot = request.slo.tpot_s
        if self._decode_tpots[tpot] == 1:
            del self._decode_tpots[tpot]
        else:
            self._decode_tpots[tpot] -= 1
        return True

    def _rank(self, request: Request, now: float) -> tuple[int, float, int]:
        """The order of eviction: the policy's urgency as if the request had made no
        progress, ties to the earlier admission.

        Strict, so that the most urgent request can always evict any other and the
        cache never deadlocks with every holder waiting for a page. Progress-blind,
        because under the slack policies (LRS, LARS) progress itself lowers urgency (w(t)
        falls, slack grows): ranked by their current keys, a request near the end of its
        prefill is the first victim, its recompute makes it the most urgent again, and it
        evicts the next one near the end -- with more prefills than the cache holds,
        nothing ever finished (a livelock; tests/test_controller.py). Ranked as if
        restarted, a victim is less urgent than its evictor even after losing its work,
        so it cannot evict it back. The packer still orders chunks by the current keys;
        FCFS and EDF keys do not depend on progress, so for them nothing changes."""
        return (*self.policy.sort_key_from_start(request, now),
                self._admission[request.request_id])

    def _pick_victim(self, requester: Request, now: float, shards: frozenset[int]
                     ) -> Request | None:
        """The lowest-priority running request holding pages on one of `shards` (where the
        requester lacks pages), outside every batch in flight (the one being packed
        included: its chunks are in flight from the moment they get their pages), if
        below the requester.

        Under kvp a request's pages are on some shards only: evicting one with no page
        where the requester needs them frees nothing it can use (and with the next
        victim, the useful one, the batch would lose two requests for one's pages)."""
        victim, victim_rank = None, self._rank(requester, now)
        holds_pages_on = self.kv.holds_pages_on
        for rid, r in self._running.items():
            if rid in self._in_flight or r is requester or \
                    not holds_pages_on(rid, shards):
                continue
            rank = self._rank(r, now)
            if rank > victim_rank:
                victim, victim_rank = r, rank
        return victim


class _KVGate:
    """The controller's side of packing one batch: KV pages for each chunk the packer wants.

    Books pages through the KVReservations and marks each granted chunk in flight (the
    controller's `in_flight` counts and the request's num_in_flight_tokens: every chunk
    the gate grants joins the batch) and its request running (in the controller's
    `running`: it holds KV from then on); everything else it may do to a request (evict
    one, requeue one whose position moved) it does through the controller's callbacks,
    so the controller's queues stay the controller's own. (The two dicts are written
    in place, not through callbacks, because every chunk of every step passes here.)"""

    def __init__(self, kv: KVReservations, now: float, *, in_flight: dict[str, int],
                 running: dict[str, Request],
                 pick_victim: Callable[[Request, float, frozenset[int]], Request | None],
                 preempt: Callable[[Request], None],
                 requeue: Callable[[Request], None]):
        self.kv, self.now, self.in_flight, self.running = kv, now, in_flight, running
        self._pick_victim, self._preempt = pick_victim, preempt
        self._requeue = requeue
        self.preempted: set[str] = set()
        self.registered: list[Request] = []   # waiting requests given pages during packing

    def prepare(self, request: Request) -> bool:
        rid = request.request_id
        if rid in self.preempted:     # preempted for a more urgent chunk of this very batch
            return False
        if request.state is _WAITING and not self.kv.has(rid):
            reused = self.kv.register(request)
            request.num_computed_tokens = request.num_cached_tokens = reused
            self.registered.append(request)
            if reused:
                self._requeue(request)
        return True

    def reserve(self, chunk: ScheduledChunk) -> bool:
        request, start, num_tokens = chunk
        rid = request.request_id
        if rid in self.preempted:
            return False
        return self._grant(request, rid, start + num_tokens, num_tokens)

    def prepare_and_reserve(self, request: Request, start: int, num_tokens: int
                            ) -> ScheduledChunk | bool:
        """`packer.prepare_then_reserve`, in one call (once per rider)."""
        rid = request.request_id
        if rid in self.preempted:
            return False
        if request.state is _WAITING and not self.kv.has(rid):   # prepare()
            reused = self.kv.register(request)
            request.num_computed_tokens = request.num_cached_tokens = reused
            self.registered.append(request)
            if reused:
                self._requeue(request)
                return True             # its next chunk starts past the cached prefix
        chunk = _new_tuple(ScheduledChunk, (request, start, num_tokens))
        return chunk if self._grant(request, rid, start + num_tokens, num_tokens) else False

    def _grant(self, request: Request, rid: str, end: int, num_tokens: int) -> bool:
        """reserve() of a chunk of num_tokens tokens that ends at `end`, of a request not
        preempted during this packing."""
        kv = self.kv
        while not kv.reserve(rid, end):
            victim = self._pick_victim(request, self.now, kv.shards_short(rid, end))
            if victim is None:
                # Nothing less urgent to evict: this chunk waits. A waiting request gives
                # back at once the cached prefix pages it took when prepared: held until
                # the end of packing, they could starve the very request that may not
                # evict it (the cache would then deadlock with pages free in name only).
                self._give_back(request)
                return False
            self._preempt(victim)
            self.preempted.add(victim.request_id)
        if request.state is _WAITING:          # its first pages: it runs from now on
            request.state = _RUNNING
            self.running[rid] = request
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.now
        in_flight = self.in_flight
        in_flight[rid] = in_flight.get(rid, 0) + 1
        request.num_in_flight_tokens += num_tokens
        return True

    def reserve_decodes(self, decodes: Sequence[Request], seats: int) -> list[ScheduledChunk]:
        """reserve() of each decode's chunk in order (`packer.reserve_each_decode`), at most
        `seats` granted. The decodes are the controller's: running, and in no batch in
        flight (a decode needs its last batch's token).

        The one loop over every decode of every step, so reserve() is inlined for the
        usual decode, whose next token fits in its pages or whose pages grow without
        evicting anyone: it is granted and marked in flight at once (one in-flight batch,
        one token). A decode whose pages cannot grow goes through reserve() (evictions,
        outside the chunks granted so far: they are in flight already)."""
        chunks: list[ScheduledChunk] = []
        append, new_chunk = chunks.append, tuple.__new__    # ScheduledChunk's __new__ is Python
        held, kv_reserve = self.kv.tokens_held, self.kv.reserve
        in_flight, preempted = self.in_flight, self.preempted
        todo = decodes
        while todo and len(chunks) < seats:
            # Seats for all of this slice: only a refused decode makes room for the next.
            head, todo = todo[:seats - len(chunks)], todo[seats - len(chunks):]
            for request in head:
                rid = request.request_id
                end = request.prompt_len + len(request.output_token_ids)
                if end > held(rid, 0) and (                 # a page more (or evicted: none)
                        rid in preempted or not kv_reserve(rid, end)):
                    chunk = new_chunk(ScheduledChunk, (request, end - 1, 1))
                    if self.reserve(chunk):             # (a failed kv reserve changed nothing)
                        append(chunk)
                    continue
                in_flight[rid] = 1
                request.num_in_flight_tokens += 1
                append(new_chunk(ScheduledChunk, (request, end - 1, 1)))
        return chunks

    def release_unscheduled(self) -> None:
        """Waiting requests registered for a chunk that missed the batch give their pages back."""
        for request in self.registered:
            if request.state is _WAITING:       # (most got their chunk: running now)
                self._give_back(request)

    def _give_back(self, request: Request) -> None:
        """Releases the pages of a waiting request registered during packing (no-op for a
        running one); it starts from its cached prefix again next time."""
        if request.state is _WAITING and self.kv.has(request.request_id):
            self.kv.release(request.request_id)
            if request.num_computed_tokens:
                request.num_computed_tokens = request.num_cached_tokens = 0
                self._requeue(request)
