"""The CDSP prefill pool as the prefill stage of a Server (seed 001, Tetris).

    Server("smollm2-135m", parallel=ParallelConfig(tp=2),
           prefill_pool=PrefillPoolConfig(devices=4))

The replicas decode; the pool's devices (taken after theirs) form one sequence-parallel
ring (`medha_jax.engine.cdsp_pool.CdspPool`). A prompt that has a full KV page and a token
more goes to the pool; others go to the replicas as without a pool.

    1. the handshake, in arrival order: when a request is among the first few waiting
       (`HANDSHAKES_AHEAD`), the freest decode replica (`serving.replicas.by_freeness`)
       reserves its full pages, on its loop thread between steps
       (`serving.pool_handoff.reserve_prompt`; pages it has cached are reused). One
       without room refuses and the next is asked; when all refused, the request asks
       again shortly, and a refused head waits (none passes it; those behind it give
       their reservations back). So the pool never computes pages no replica can take.
    2. planned: `medha_jax.scheduler.cdsp.CdspScheduler` plans the prompt's full pages as
       chunks on nested aligned groups from each device's queue, the seconds until it is
       free by the plans booked so far (Eq. 2), with Eq. 1 fitted per group size from
       chunk steps timed when the pool starts (`calibrate`)
    3. the chunks are dispatched at once, in order: JAX runs each step when its devices'
       earlier steps are done, so chunks on disjoint groups run at the same time; then the
       full pages' K/V are gathered (`serving.pool_handoff.gather_prompt`)
    4. once they are computed (a waiter thread blocks on them), the pool frees its pages;
       the replica that reserved writes them into its reservation (`place_prompt`) and
       the request takes them (`add_request(kv_from=)`), computing only its last partial
       page (at least one token) and sampling its first token there, so sampling is the
       replica's own. A reservation whose request ends first (cancelled, failed, the pool
       closed or died) is freed; if the replica that reserved went down meanwhile,
       another reserves and takes the pages at the hand-off.

Where this departs from the paper, and why:
  - The pool computes the prompt's full pages only, and the decode replica computes the
    rest (under a page) and samples: one sampler for every request (seeds, logprobs, stop
    rules), at the cost of a few tokens in a decode step. Prompts that ask for prompt
    logprobs, or for n > 1 samples, are served by the replicas (the pool keeps no logits).
  - A planned chunk longer than a group's compiled steps take (`most_chunk_tokens`) runs as
    several steps on that group; Eq. 1 priced it as one.
  - The improvement rate is looked up per arrival rate as in the paper
    (`AdaptiveImprovementRate`), but the table is profiled by simulation when the pool
    starts, on prompts drawn log-uniform over what the pool takes, since the pool does not
    know its workload's traces (`profile_improvement`).
  - Decode routing is Tetris's freeness (free pages per running request) with the
    reservations the handshakes made counting as used, its virtual usage; it is chosen at
    the handshake, before the prefill, rather than when the prefill ends.
  - A plan whose pages do not fit the pool now runs as one chunk on the whole pool if that
    fits; else the request waits (the queue's head; none passes it) until a prefill ends.
    A prompt the empty pool cannot hold is prefilled by a decode replica.
  - The queues are the plans' predictions (Eq. 2); measured ends are not booked back,
    since dispatch does not wait for steps (only the calibration's are timed).
  - The pool does not know the replicas' prefix caches: it prefills every full page, and
    a replica that has some of them cached reuses its own and writes the rest.

Compiles: before the Server is ready, on each replica the page writes
(`serving.kv_copy.warm_up`) and the layout of every size of gathered K/V as pages
(`serving.pool_handoff.warm_up_placement`); the pool's programs (`CdspPool.program_keys`)
then too with warmup=True, or on a background thread with "background" (the Server's
default). With warmup=False each compiles as first needed.

Threads: the pool thread owns the CdspPool (plans, dispatches, frees); one waiter thread
per request in the pool blocks on its gathered K/V; decode replicas' caches are touched
only on their loop threads (`ServingLoop.call`). A request is in exactly one place: the
pool's table until the moment it is added to a loop, under the pool's lock, so a cancel
that asks the pool first and then the loops always finds it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import threading
import time
from collections.abc import Sequence

import jax
import numpy as np

from medha_jax.kv_cache.allocator import free_if_held
from medha_jax.request import FinishReason
from medha_jax.scheduler.cdsp import (AdaptiveImprovementRate, CdspConfig, CdspScheduler,
                                      ImprovementRateTable, LatencyModel, fit_latency_models)
from serving.kv_copy import PageWriter, padded_count, page_scatter, warm_up
from serving.kv_transfer import reservation_id
from serving.outputs import RequestStream
from serving.pool_handoff import (PromptKV, gather_prompt, place_prompt, reserve_prompt,
                                  warm_up_placement)
from serving.replicas import by_freeness, by_queued_work

logger = logging.getLogger(__name__)

# When every decode replica refused to reserve the head's pages: seconds until it asks again
# (pages come back as their requests finish; a decode step is milliseconds to a second).
HANDSHAKE_RETRY_S = 0.05
# The waiting requests at the queue's front that ask for their reservations before their
# turn, so a replica's step between the asks does not hold each prefill up in turn (a
# few: a reservation holds the replica's pages from then on).
HANDSHAKES_AHEAD = 4


@dataclasses.dataclass(frozen=True)
class PrefillPoolConfig:
    """devices: the ring's devices (a power of two), the first ones after the replicas'.
    pages_per_device, rank_token_buckets: each device's KV pages and the per-device token
      counts a chunk step is compiled for (`medha_jax.engine.cdsp_pool.PoolConfig`; the
      page size is the replicas').
    min_prompt_tokens: shorter prompts are prefilled by the replicas (a chat does not
      need the ring). A prompt also needs a full page and one token more.
    improvement_rate: r of Algorithm 2 (a larger group must cut the TTFT by more than r);
      None: chosen per arrival rate, as the paper does, from a table the pool profiles by
      simulation when it starts (`profile_improvement`), looked up from the arrivals of
      the last minute (`AdaptiveImprovementRate`).
    cdsp: the planner's config; None: aligned groups of every size up to `devices`, one
      node, chunks in whole pages of at least the smallest rank-token bucket's tokens."""

    devices: int = 2
    pages_per_device: int = 64
    rank_token_buckets: tuple[int, ...] = (16, 64, 256)
    min_prompt_tokens: int = 0
    improvement_rate: float | None = None
    cdsp: CdspConfig | None = None

    def __post_init__(self):
        if self.devices < 1 or self.devices & (self.devices - 1):
            raise ValueError(f"PrefillPoolConfig.devices must be a power of two, got "
                             f"{self.devices}")
        if self.min_prompt_tokens < 0:
            raise ValueError(f"PrefillPoolConfig.min_prompt_tokens must be >= 0, got "
                             f"{self.min_prompt_tokens}")
        if self.improvement_rate is not None and not 0 <= self.improvement_rate < 1:
            raise ValueError(f"PrefillPoolConfig.improvement_rate must be in [0, 1) or None, "
                             f"got {self.improvement_rate}")
        if self.cdsp is not None and not self.cdsp.aligned:
            raise ValueError("PrefillPoolConfig.cdsp must plan aligned groups "
                             "(CdspConfig(aligned=True)): the pool compiles a program per block")

    def planner(self, page_size: int) -> CdspConfig:
        if self.cdsp is not None:
            return self.cdsp
        sizes = tuple(1 << i for i in range(self.devices.bit_length()))
        smallest = -(-min(self.rank_token_buckets) // page_size) * page_size
        return CdspConfig(node_size=self.devices, sp_sizes=sizes, aligned=True,
                          min_chunk_tokens=smallest, chunk_multiple=page_size)


@dataclasses.dataclass(eq=False)
class _Entry:
    """A request the pool holds: waiting, prefilling, or being handed to a replica."""

    stream: RequestStream
    tokens: int                          # the full pages' tokens the pool prefills
    cancelled: bool = False
    prompt: PromptKV | None = None       # gathered, once dispatched
    arrived: float = 0.0                 # time.monotonic() when added
    improvement_rate: float = 0.0        # the planner's r, from the arrival rate then
    # The handshake: the decode replica asked to reserve the full pages (answer pending),
    # the ones that refused this round, and the one that granted, its reservation's id
    # and the prompt tokens it had cached.
    asked: int | None = None
    refused: set[int] = dataclasses.field(default_factory=set)
    decode: int | None = None
    reservation: str = ""
    reused: int = 0
    retry_at: float | None = None        # every replica refused: ask again then
    dispatched: float = 0.0              # perf_counter at dispatch


class PrefillPool:
    """The pool's thread, its queue and its hand-offs (see the module's docstring)."""

    def __init__(self, model, config: PrefillPoolConfig, replicas: Sequence, *, metrics,
                 warmup: bool | str):
        """model: the Model on the pool's cp = devices mesh; replicas: the decode replicas
        (each with a `loop` and an `engine`, one page size). warmup: True compiles every
        pool program first (`CdspPool.program_keys`: hundreds for many buckets and
        devices), "background" on a thread while the pool serves (a plan that needs one
        sooner compiles it), False each as first needed; with either of the first two
        the replicas' hand-off programs compile first (`warm_up_replicas`)."""
        from medha_jax.engine.cdsp_pool import CdspPool, PoolConfig

        self.config, self.replicas, self.metrics = config, list(replicas), metrics
        self.page_size = self.replicas[0].engine.allocator.page_size
        self.pool = CdspPool(model, PoolConfig(page_size=self.page_size,
                                               pages_per_device=config.pages_per_device,
                                               rank_token_buckets=config.rank_token_buckets))
        self.num_pages = self.pool.num_free_pages
        # One writer per replica: its scatter is compiled once (per padded page count).
        self._scatters = [page_scatter(r.engine) for r in self.replicas]
        self._writers = [PageWriter(r.engine, scatter)
                         for r, scatter in zip(self.replicas, self._scatters)]
        if warmup:
            self.warm_up_replicas()
        if warmup is True:
            self.pool.warmup(self.pool.program_keys())
        self.models = calibrate(self.pool)
        self.scheduler = CdspScheduler(config.devices, self.models,
                                       config.planner(self.page_size))
        self.improvement = None                    # None: the config's fixed rate
        if config.improvement_rate is None:
            self.improvement = AdaptiveImprovementRate(profile_improvement(
                self.scheduler, smallest_prompt=max(config.min_prompt_tokens,
                                                    self.page_size + 1),
                largest_prompt=self.num_pages * self.page_size))
        self._free_at = [0.0] * config.devices     # monotonic time each device is free
        self._tids = itertools.count(1)
        self._lock = threading.Condition()
        self._inbox: list[tuple[str, object]] = []
        self._table: dict[str, _Entry] = {}          # every request the pool holds
        self._waiting: collections.deque[str] = collections.deque()
        self._running: set[str] = set()              # dispatched, not yet computed
        # (the head of the queue, the free pages) when its plans last did not fit
        self._blocked: tuple[str, int] | None = None
        self._retry_at: float | None = None  # the soonest a refused request asks again
        self._closing = self._drain = False
        self._dead = False                   # the thread died: requests go to the replicas
        self._stopped = False                # the thread ended: no grant is taken any more
        self.prefilled = 0               # requests handed to a replica with the pool's pages
        self.thread = threading.Thread(target=self._run, name="medha-prefill-pool",
                                       daemon=True)
        self.thread.start()
        self._warming = None
        if warmup and warmup is not True:
            self._warming = threading.Thread(target=self._warm_up_pool, daemon=True,
                                             name="medha-prefill-pool-warmup")
            self._warming.start()

    def warm_up_replicas(self) -> int:
        """Compiles what a hand-off runs on each replica: its page writes and the layout of
        every size of gathered K/V as pages. Only while no request is in flight (the
        replicas' caches belong to their loop threads). Returns the shapes compiled."""
        count = 0
        for replica, scatter, writer in zip(self.replicas, self._scatters, self._writers):
            count += warm_up(replica.engine, scatter, padded_count(
                min(self.num_pages, replica.engine.allocator.num_pages)))
            count += warm_up_placement(self.pool, replica.engine, writer)
        return count

    def _warm_up_pool(self) -> None:
        """The background warm-up: one program at a time, until done or closing (a
        process must not exit in the middle of a compile)."""
        try:
            for key in self.pool.program_keys():
                if self._closing:
                    return
                self.pool.warmup([key], strict=False)
        except Exception:
            logger.exception("compiling the prefill pool's programs in the background "
                             "failed; each compiles when first needed")

    # ------------------------------------------------------------ any thread

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free_pages

    def accepts(self, prompt_len: int, sampling) -> bool:
        """Whether a request goes to the pool (else to the replicas, also once the pool's
        thread has died)."""
        return (sampling.n == 1 and sampling.prompt_logprobs is None
                and (prompt_len - 1) // self.page_size >= 1
                and prompt_len >= self.config.min_prompt_tokens and not self._dead)

    def add(self, stream: RequestStream) -> bool:
        """Queues a validated request (`accepts`). False, with nothing queued, when the
        pool's thread has died (the caller sends it to a replica); raises RuntimeError once
        the pool is closed."""
        request = stream.request
        entry = _Entry(stream, (request.prompt_len - 1) // self.page_size * self.page_size,
                       arrived=time.monotonic())
        with self._lock:
            if self._dead:
                return False
            if self._closing:
                raise RuntimeError("the server is closed")
            self._table[request.request_id] = entry
            self._inbox.append(("add", request.request_id))
            self._lock.notify()
        return True

    def cancel(self, request_id: str) -> bool:
        """Cancels a request the pool holds; False when it holds none of that id (it may
        be on a replica's loop: ask the loops next)."""
        with self._lock:
            entry = self._table.get(request_id)
            if entry is None or entry.cancelled:
                return False
            entry.cancelled = True
            self._inbox.append(("cancel", request_id))
            self._lock.notify()
        return True

    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stops the pool: cancels what it holds (or with drain=True hands everything on
        first), waits for the steps in flight and frees their pages. Idempotent."""
        with self._lock:
            self._closing, self._drain = True, drain
            self._lock.notify()
        for thread in (self.thread, self._warming):
            if thread is not None:
                thread.join(timeout)
                if thread.is_alive():
                    raise TimeoutError(f"the prefill pool did not stop within {timeout=} s")

    # ------------------------------------------------------------ the pool thread

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException:
            # The thread dies: what the pool holds is prefilled by the replicas instead (a
            # request added meanwhile too: `add` takes the lock this takes), none is lost.
            logger.exception("the prefill pool's thread died; the replicas prefill its "
                             "requests")
            with self._lock:
                self._dead = True              # `add` refuses from now on
                held = list(self._table.values())
            self._stop_taking_grants()
            for entry in held:
                try:
                    self._release_reservation(entry)
                    self._to_replica(entry, None)
                except Exception:
                    logger.exception("request %s was lost with the prefill pool",
                                     entry.stream.request_id)
            raise

    def _stop_taking_grants(self) -> None:
        """From now on `_reserve` frees what it reserves; the grants posted before are
        freed here."""
        with self._lock:
            self._stopped = True
            late = [arg for kind, arg in self._inbox if kind == "granted"]
            self._inbox = [c for c in self._inbox if c[0] != "granted"]
        for _, replica, reservation, _ in late:
            self._free_reservation(replica, reservation)

    def _serve(self) -> None:
        while True:
            if not self._waiting:
                self._retry_at = None
            with self._lock:
                while not (self._inbox or self._closing):
                    if self._retry_at is None:
                        self._lock.wait()
                    elif not self._lock.wait(max(0.0, self._retry_at - time.monotonic())):
                        break                      # time to ask the replicas again
                commands, self._inbox = self._inbox, []
                closing, drain = self._closing, self._drain
            for kind, arg in commands:
                rid = arg if isinstance(arg, str) else arg[0]
                try:
                    if kind == "add":
                        self._waiting.append(rid)
                        self._observe_arrival(self._table[rid])
                    elif kind == "cancel":
                        if rid in self._waiting:
                            self._waiting.remove(rid)
                            self._end(rid, FinishReason.CANCELLED)
                    elif kind == "granted":
                        self._granted(*arg)
                    elif kind == "refused":
                        self._refused(*arg)
                    else:
                        self._computed(*arg)
                except Exception as e:
                    logger.exception("the prefill pool failed on request %s", rid)
                    if rid in self._table:
                        self._end(rid, FinishReason.ERROR,
                                  f"prefill pool failed: {type(e).__name__}: {e}")
            if closing and not drain:
                for rid in list(self._waiting):
                    self._end(rid, FinishReason.CANCELLED)
                self._waiting.clear()
            try:
                self._admit()
            except Exception:
                logger.exception("the prefill pool failed to admit a request")
            if self.metrics is not None:
                self.metrics.prefill_pool_waiting.set(len(self._waiting))
            if closing and not self._running and not self._waiting:
                self._stop_taking_grants()
                return
            if closing and not commands:
                with self._lock:                 # steps in flight: their waiters post
                    if not self._inbox:
                        self._lock.wait(0.05)

    def _observe_arrival(self, entry: _Entry) -> None:
        """Fixes the request's improvement rate from the arrival rate when it came (in
        arrival order: `add` queues under the lock)."""
        if self.improvement is None:
            entry.improvement_rate = self.config.improvement_rate
            return
        entry.improvement_rate = self.improvement.observe(entry.arrived)
        if self.metrics is not None:
            self.metrics.prefill_pool_improvement_rate.set(entry.improvement_rate)

    def _admit(self) -> None:
        """Plans and dispatches the waiting requests in arrival order, while their pages
        fit."""
        while self._waiting:
            rid = self._waiting[0]
            entry = self._table.get(rid)
            if entry is None or entry.cancelled:     # ended, or cancelled, meanwhile
                self._waiting.popleft()
                if entry is not None:
                    self._end(rid, FinishReason.CANCELLED)
                continue
            # The handshake first: a decode replica reserves the pages it will take before
            # the pool computes them, so the hand-off never lacks pages.
            self._ask_ahead()
            if entry.decode is None:
                return
            if self._blocked == (rid, self.pool.num_free_pages):
                return                 # no page came back since its plans did not fit
            chunks, booking = self._plan(entry.tokens, entry.improvement_rate)
            if not self.pool.can_book(entry.tokens, chunks):
                chunks, booking = self._whole_pool(entry.tokens)
                if not self.pool.can_book(entry.tokens, chunks):
                    if self._running:
                        # Pages come back as prefills end: plan it again then.
                        self._blocked = (rid, self.pool.num_free_pages)
                        return
                    self._waiting.popleft()
                    logger.warning("request %s: the prefill pool cannot hold %d tokens; a "
                                   "replica prefills it", rid, entry.tokens)
                    self._release_reservation(entry)
                    self._to_replica(entry, None)
                    continue
            self._waiting.popleft()
            try:
                self.pool.add(rid, entry.stream.request.prompt_token_ids[:entry.tokens])
                try:
                    for tokens, group in chunks:
                        self.pool.dispatch_chunk(rid, tokens, group)
                    entry.prompt = gather_prompt(self.pool, rid)
                except Exception:
                    self.pool.release(rid)
                    raise
            except Exception:
                logger.exception("request %s: the prefill pool failed to dispatch it; a "
                                 "replica prefills it", rid)
                self._release_reservation(entry)
                self._to_replica(entry, None)
                continue
            for devices, end in booking:           # Eq. 2
                for i in devices:
                    self._free_at[i] = end
            entry.dispatched = time.perf_counter()
            self._running.add(rid)
            threading.Thread(target=self._wait_for, args=(rid, entry.prompt.kv),
                             name=f"medha-prefill-pool-{rid}", daemon=True).start()

    def _ask_ahead(self) -> None:
        """The handshakes of the first `HANDSHAKES_AHEAD` waiting requests, in arrival
        order (each replica reserves in the order it is asked). When every replica refused
        the head, the ones behind it give back what they reserved and ask no more until
        it is granted: they cannot be prefilled before it, and their pages may be what it
        waits for."""
        front = [entry for entry in (self._table.get(rid) for rid in
                                     itertools.islice(self._waiting, HANDSHAKES_AHEAD))
                 if entry is not None and not entry.cancelled]
        for k, entry in enumerate(front):
            self._handshake(entry)
            if k == 0 and entry.decode is None and entry.retry_at is not None:
                for behind in front[1:]:
                    self._release_reservation(behind)
                front = front[:1]
                break
        # Ask again when refused; and look again while an answer is pending: a replica that
        # goes down drops the calls posted to it, and nothing else would wake this thread.
        now = time.monotonic()
        retries = [e.retry_at if e.asked is None else now + HANDSHAKE_RETRY_S
                   for e in front if e.retry_at is not None or e.asked is not None]
        self._retry_at = min(retries) if retries else None

    def _handshake(self, entry: _Entry) -> None:
        """Asks the freest decode replica (`by_freeness`), of those that did not refuse this
        round, to reserve the request's full pages (`_reserve`, on its loop thread;
        the answer comes back as a command). When every one refused, asks again in
        `HANDSHAKE_RETRY_S`."""
        if entry.asked is not None and not self.replicas[entry.asked].loop.healthy:
            self._refused(entry.stream.request_id, entry.asked)   # its calls are dropped
        if entry.decode is not None or entry.asked is not None or (
                entry.retry_at is not None and time.monotonic() < entry.retry_at):
            return
        entry.retry_at = None
        stream = entry.stream
        for i in by_freeness(self.replicas, range(len(self.replicas))):
            if i in entry.refused:
                continue
            reservation = reservation_id(stream.request_id, next(self._tids))
            ids, full = stream.request.prompt_token_ids, entry.tokens // self.page_size
            entry.asked = i
            if self.replicas[i].loop.call(lambda i=i, r=reservation:
                                          self._reserve(i, stream.request_id, r, ids, full)):
                return
            entry.asked = None                     # that loop stopped meanwhile
            entry.refused.add(i)
        entry.refused.clear()
        entry.retry_at = time.monotonic() + HANDSHAKE_RETRY_S

    def _reserve(self, replica: int, rid: str, reservation: str, prompt_ids,
                 full_pages: int) -> None:
        """On the decode replica's loop thread: the reservation, answered to the pool."""
        engine = self.replicas[replica].engine
        try:
            reused = reserve_prompt(engine, reservation, prompt_ids, full_pages)
        except Exception as e:                     # noqa: BLE001 - refused, said below
            if not isinstance(e, MemoryError):
                logger.exception("request %s: replica %d failed to reserve its pages", rid,
                                 replica)
            answer = ("refused", (rid, replica))
        else:
            answer = ("granted", (rid, replica, reservation, reused))
        with self._lock:
            if self._stopped:
                if answer[0] == "granted":
                    free_if_held(engine.allocator, reservation)
                return
            self._inbox.append(answer)
            self._lock.notify()

    def _granted(self, rid: str, replica: int, reservation: str, reused: int) -> None:
        entry = self._table.get(rid)
        if entry is None or entry.cancelled or entry.asked != replica:
            self._free_reservation(replica, reservation)   # it ended or was cancelled
            return
        entry.asked, entry.decode, entry.reservation, entry.reused = (
            None, replica, reservation, reused)

    def _refused(self, rid: str, replica: int) -> None:
        entry = self._table.get(rid)
        if entry is not None and entry.asked == replica:
            entry.asked = None
            entry.refused.add(replica)
        if self.metrics is not None:
            self.metrics.prefill_pool_refusals.inc()

    def _release_reservation(self, entry: _Entry) -> None:
        """Frees the request's reservation on its decode replica (it will not take it)."""
        if entry.decode is not None:
            self._free_reservation(entry.decode, entry.reservation)
            entry.decode = None

    def _free_reservation(self, replica: int, reservation: str) -> None:
        engine = self.replicas[replica].engine
        # A stopped loop frees nothing more: its pool is gone with it.
        self.replicas[replica].loop.call(lambda: free_if_held(engine.allocator, reservation))

    def _plan(self, tokens: int, improvement_rate: float):
        """(chunks as (tokens, group) steps, Eq. 2's bookings as (devices, end time))."""
        from medha_jax.engine.cdsp_pool import group_of

        now = time.monotonic()
        plan = self.scheduler.plan(tokens, [max(0.0, f - now) for f in self._free_at],
                                   improvement_rate)
        chunks = [step for c in plan.chunks for step in
                  self._steps(c.tokens, group_of(c.group, self.config.devices))]
        return chunks, [(c.group, now + c.end_s) for c in plan.chunks]

    def _whole_pool(self, tokens: int):
        """The prompt as one chunk on every device (spread evenly: the least pages on any)."""
        n = self.config.devices
        now = time.monotonic()
        start = max(now, max(self._free_at))
        end = start + self.models[n].seconds(0, tokens)
        return self._steps(tokens, (0, n)), [(range(n), end)]

    def _steps(self, tokens: int, group) -> list[tuple[int, tuple[int, int]]]:
        """A chunk as steps the group's compiled programs take."""
        most = self.pool.most_chunk_tokens(group)
        return [(min(most, tokens - done), group) for done in range(0, tokens, most)]

    def _wait_for(self, rid: str, kv) -> None:
        """Waiter thread: blocks until the request's K/V are computed."""
        error = None
        try:
            jax.block_until_ready(kv)
        except Exception as e:                       # noqa: BLE001 - reported below
            error = f"{type(e).__name__}: {e}"
        with self._lock:
            self._inbox.append(("computed", (rid, error)))
            self._lock.notify()

    def _computed(self, rid: str, error: str | None) -> None:
        self._running.discard(rid)
        self.pool.release(rid)
        entry = self._table[rid]
        if entry.cancelled or (self._closing and not self._drain):
            self._end(rid, FinishReason.CANCELLED)
        elif error is not None:
            logger.error("request %s: its prefill in the pool failed (%s); a replica "
                         "prefills it", rid, error)
            self._release_reservation(entry)
            self._to_replica(entry, None)
        else:
            if self.metrics is not None:
                self.metrics.prefill_pool_time.observe(time.perf_counter() - entry.dispatched)
            self._hand_over(entry)

    def _hand_over(self, entry: _Entry) -> None:
        """The computed pages to the replica holding the request's reservation: written
        there, then the request added to take them. If that replica went away meanwhile,
        to another (`_to_replica`, which reserves anew)."""
        if self._add_to(entry, entry.decode, entry.prompt, entry.reservation, entry.reused):
            return
        self._release_reservation(entry)
        self._to_replica(entry, None if entry.cancelled else entry.prompt)

    def _to_replica(self, entry: _Entry, prompt: PromptKV | None) -> None:
        """Adds the request to the healthy replica with the least queued work, with the
        pool's pages (`prompt`, reserved there now) or, without, to be prefilled there."""
        rid = entry.stream.request_id
        for i in by_queued_work(self.replicas, range(len(self.replicas))):
            reservation = reservation_id(rid, next(self._tids)) if prompt is not None else ""
            if self._add_to(entry, i, prompt, reservation, None):
                return
            if entry.cancelled:
                break
        if entry.cancelled:
            self._end(rid, FinishReason.CANCELLED)
        else:
            self._end(rid, FinishReason.ERROR, "unavailable: no replica could take the "
                      "request from the prefill pool", unavailable=True)

    def _add_to(self, entry: _Entry, i: int, prompt: PromptKV | None, reservation: str,
                reused: int | None) -> bool:
        """Adds the request to replica i, with the pool's pages written first into
        `reservation` when `prompt` is given (`reused`: see `_place`). Under the pool's
        lock, so a cancel finds the request in the pool or on the loop. False, the request
        still the pool's, when it was cancelled or the replica would not take it."""
        stream, rid = entry.stream, entry.stream.request_id
        loop, engine = self.replicas[i].loop, self.replicas[i].engine
        with self._lock:
            if entry.cancelled:
                return False
            kv_from = None
            if prompt is not None:
                if not loop.call(lambda: self._place(engine, prompt, reservation,
                                                     stream.request.prompt_token_ids,
                                                     self._writers[i], reused)):
                    return False
                kv_from = (reservation, entry.tokens)
            stream.resume(stream.request, i)
            try:
                loop.add(stream, kv_from=kv_from)
            except (RuntimeError, ValueError):
                logger.warning("request %s: replica %d refused it", rid, i)
                if kv_from is not None:
                    loop.call(lambda: free_if_held(engine.allocator, reservation))
                return False
            del self._table[rid]
            self.prefilled += prompt is not None
            self._count("prefilled" if prompt is not None else "replica")
            return True

    @staticmethod
    def _place(engine, prompt: PromptKV, reservation: str, prompt_ids, writer,
               reused: int | None = None) -> None:
        """On the replica's loop thread, before the request's add: its pages from the pool,
        into the reservation the handshake made (`reused` tokens of it were cached), or
        reserved now (none when the replica cannot now: it prefills the request itself)."""
        try:
            place_prompt(prompt, engine, reservation, prompt_ids, writer, reused)
        except MemoryError as e:
            logger.warning("%s; the replica prefills the request itself", e)
        except Exception:
            logger.exception("writing the prefill pool's pages failed; the replica "
                             "prefills the request itself")
            free_if_held(engine.allocator, reservation)

    def _end(self, rid: str, reason: FinishReason, error: str | None = None, *,
             unavailable: bool = False) -> None:
        with self._lock:
            entry = self._table.pop(rid)
        self._release_reservation(entry)
        metrics = entry.stream.finish(reason, error, unavailable=unavailable)
        if self.metrics is not None:
            self.metrics.observe_finished(metrics, reason.value)
        self._count("cancelled" if reason is FinishReason.CANCELLED else "failed")

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.prefill_pool_requests.labels(outcome).inc()


# Algorithm 2's r: the candidates the start-up profile searches (the paper's sweep spans
# 0-0.75; above ~0.5 a larger group is almost never taken).
IMPROVEMENT_RATE_CANDIDATES = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)
# Arrival rates profiled, as fractions of the pool's throughput bound.
PROFILED_LOADS = (0.2, 0.4, 0.6, 0.8, 1.0)


def profile_improvement(scheduler: CdspScheduler, *, smallest_prompt: int,
                        largest_prompt: int, num_requests: int = 200,
                        seed: int = 0) -> ImprovementRateTable:
    """Section 5.1's offline profile, run when the pool starts: at each arrival rate the
    rate r with the least mean simulated TTFT (`profile_improvement_rates`), the pool's own
    planner and fitted Eq. 1 driving the simulator.

    The paper profiles on its workload's traces; a pool does not know its workload when it
    starts, so prompts are drawn log-uniform between the smallest the pool takes and the
    most its pages hold, and the arrival rates are `PROFILED_LOADS` of the pool's
    throughput bound (every device prefilling its own prompts: devices / the mean
    one-device seconds). About 6,000 plans: a fraction of a second at 8 devices."""
    from medha_jax.cluster.prefill_pool_sim import profile_improvement_rates

    low, high = math.log(smallest_prompt), math.log(max(largest_prompt, smallest_prompt))

    def lengths(n: int, rng_seed: int) -> list[int]:
        rng = np.random.default_rng(rng_seed)
        return [int(x) for x in np.exp(rng.uniform(low, high, n))]

    one = scheduler.models[1]
    capacity = scheduler.num_instances / float(np.mean(
        [one.seconds(0, n) for n in lengths(1000, seed)]))
    return profile_improvement_rates(
        lengths, [load * capacity for load in PROFILED_LOADS], IMPROVEMENT_RATE_CANDIDATES,
        lambda: scheduler, num_requests=num_requests, seed=seed)


def calibrate(pool) -> dict[int, LatencyModel]:
    """Eq. 1 per group size, fitted (`fit_latency_models`) to chunk steps timed on the
    pool: for each size s on its first block, chunks of a quarter, a half and all of
    s x the smallest rank-token bucket without history and a quarter after a quarter
    (three chunk lengths fix alpha, beta and delta; the history, gamma). Each is run
    twice and the second timed (the first may compile)."""
    smallest = min(pool.config.rank_token_buckets)
    samples = []
    for size in (1 << i for i in range(pool.num_devices.bit_length())):
        group = (0, size)
        full = min(size * smallest, pool.most_chunk_tokens(group))
        quarter, half = max(1, full // 4), max(1, full // 2)
        for chunks in ([quarter, quarter], [half], [full]):
            for timed in (False, True):
                sequence = f"calibrate-{size}-{len(samples)}-{timed}"
                pool.add(sequence, np.zeros(sum(chunks), np.int32))
                before = len(pool.steps)
                try:
                    for tokens in chunks:
                        pool.prefill_chunk(sequence, tokens, group)
                finally:
                    pool.release(sequence)
                if timed:
                    samples += pool.steps[before:]
    return fit_latency_models(samples)
