"""Prefill on one replica, decode on another: the handshake and the streamed KV hand-off
between replicas of one process (seeds 001 and 003).

    request placed on P (router), decode chosen on D (medha_jax.cluster.offload)
      1. handshake: D reserves every full prompt page (first-come order; pages D already
         has cached are reused and not moved). A mixed P starts the prefill at once, beside
         the handshake: waiting for the grant would put D's step (the handshake runs
         between D's steps) and its page queue into the TTFT, which the offload decision
         prices as P's alone. If P's prefill ends before the grant, the request decodes
         on P (plan (a)) and the reservation is dropped. A prefill-only P waits for it.
      2. P prefills; after each step, the pages that became full are gathered and
         `jax.device_put` to D's devices (asynchronous: the copy overlaps P's next chunk)
         and written on D's loop thread into the reserved pages
      3. P samples the first token and sends the prompt's partial last page too (TTFT is
         P's); P pins the full pages (a hold) and D registers them in its prefix cache
         under the prompt's page hashes (seed 003 H6), then runs the request from prompt
         + first token: it takes the reservation's pages and computes only the first
         token, a decode step. (Pages re-homed from the hold after a decode side died are
         the full ones only: that request takes them by prefix reuse and computes the
         partial page again.)
      4. D acknowledges; P drops its hold (the pages stay in P's prefix cache)

Ownership. Every reservation has its own transfer id (a generation: a request moved to
another decode replica gets a new one), and it is the allocator id of the reserved pages
(`kv-in:{request}:{tid}`). A write names that id and the decode thread looks it up when it
lands, so a write of a cancelled, timed-out or re-routed transfer finds nothing and is
dropped: it can never reach pages that now belong to another request.

Faults. D dies after P finished and before it acknowledged: P still holds the pages, so
they go to another decode replica (a new handshake, no re-prefill).
P dies mid-transfer: D registers the pages that arrived in its prefix cache and frees the
rest; the request is re-run by the replica set (serving.replicas), which the router sends
where those pages are, so only what did not arrive is recomputed. The client cancels: the
reservation is freed. A handshake not granted within `handshake_timeout_s`, or a prefill
not done within `transfer_timeout_s`, gives the request back to co-located serving.

Threads: each engine's cache and allocator are touched only on its loop thread
(`ServingLoop.call` posts work there, in order with adds); this object's own state is
under one lock. Within a step, pages move per chunk (after the step that computed them),
not per layer: the layers of a step run as one scanned program, which has no point to
hand pages out from.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

import numpy as np

from medha_jax.kv_cache.allocator import free_if_held
from medha_jax.request import RequestState
from serving.kv_copy import PageCopier, page_scatter, warm_up

logger = logging.getLogger(__name__)

MIXED, PREFILL, DECODE = "mixed", "prefill", "decode"
ROLES = (MIXED, PREFILL, DECODE)


def parse_roles(spec, num_replicas: int) -> tuple[str, ...]:
    """Replica roles from "prefill:1,decode:1" (counts in replica order), a sequence of
    role names (one per replica), or None (all mixed)."""
    if spec is None:
        return (MIXED,) * num_replicas
    if isinstance(spec, str):
        roles: list[str] = []
        for part in spec.split(","):
            name, _, count = part.strip().partition(":")
            if name not in ROLES:
                raise ValueError(f"roles: unknown role {name!r} in {spec!r}; choose from "
                                 f"{', '.join(ROLES)}")
            try:
                n = int(count) if count else 1
            except ValueError:
                raise ValueError(f"roles: {part!r} must be ROLE or ROLE:COUNT") from None
            if n < 1:
                raise ValueError(f"roles: count of {name!r} must be >= 1, got {n}")
            roles += [name] * n
    else:
        roles = list(spec)
        for name in roles:
            if name not in ROLES:
                raise ValueError(f"roles: unknown role {name!r}; choose from {', '.join(ROLES)}")
    if len(roles) != num_replicas:
        raise ValueError(f"roles name {len(roles)} replicas but replicas={num_replicas}")
    if DECODE in roles and not any(r != DECODE for r in roles):
        raise ValueError("roles: every replica decodes only; at least one must prefill")
    if PREFILL in roles and not any(r != PREFILL for r in roles):
        raise ValueError("roles: every replica prefills only; at least one must decode")
    return tuple(roles)


@dataclasses.dataclass(frozen=True)
class DisaggConfig:
    """handshake_timeout_s: a reservation not granted by then -> the request is served
    co-located. transfer_timeout_s: a prefill not finished by then -> the reservation is
    freed and the request decodes where it prefilled. ack_timeout_s: a decode side that
    is alive but has not acknowledged by then (its loop stuck): the prefill side stops
    pinning the pages (they stay in its prefix cache); the request stays there, since
    moving it could serve it twice. A decode side that died before acknowledging gets no
    timeout: the pages go to another one at once.
    stream_chunks: False ships every page only after the prefill (the baseline the
    benchmark compares against). sweep_interval_s: how often timeouts and ends the loops
    did not report are looked for (None: only when `KVTransfers.sweep` is called)."""

    handshake_timeout_s: float = 30.0
    transfer_timeout_s: float = 300.0
    ack_timeout_s: float = 30.0
    stream_chunks: bool = True
    sweep_interval_s: float | None = 0.05

    def __post_init__(self):
        for name in ("handshake_timeout_s", "transfer_timeout_s", "ack_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DisaggConfig.{name} must be > 0, got {getattr(self, name)!r}")


@dataclasses.dataclass
class _Transfer:
    stream: object
    tokens: list[int]
    prefill: int
    decode: int
    tid: int
    num_pages: int                 # full prompt pages the decode side needs
    created: float
    state: str = "handshake"       # handshake, streaming, rehoming, handing, done, aborted
    start: int = 0                 # pages the decode side had cached (not moved)
    sent: int = 0                  # pages [start, sent) dispatched to the decode side
    hold: str | None = None        # the prefill side's pin on the pages until the ack
    resumed: object = None         # the request the decode side runs
    handed_at: float = 0.0
    failed_decodes: set = dataclasses.field(default_factory=set)
    started: bool = False          # in P's loop before the grant (a mixed P)
    whole_prompt_tid: int | None = None   # the transfer whose reservation got every prompt page

    @property
    def request_id(self) -> str:
        return self.stream.request_id


@dataclasses.dataclass
class _Reservation:
    request_id: str
    tokens: list[int]
    landed: int                    # leading pages of its table written (or cached there)
    waits_for: object = None       # the decode request that will take the pages


@dataclasses.dataclass
class TransferRecord:
    """One completed hand-off, for benchmarks: pages moved, their bytes, when the prefill
    side sent its first and last pages and sampled the first token, and when the decode
    side registered them (time.perf_counter()); the prompt tokens the prefill found cached
    (the decode side's request counts the moved pages as cached)."""

    request_id: str
    prefill: int
    decode: int
    pages_moved: int
    pages_cached_there: int
    bytes_moved: int
    first_send: float | None
    last_send: float | None
    prefilled: float
    registered: float | None = None
    prefill_cached_tokens: int = 0


class KVTransfers:
    """The hand-offs of one ReplicaSet (see the module's docstring)."""

    def __init__(self, replica_set, config: DisaggConfig = DisaggConfig()):
        self.set = replica_set
        self.config = config
        self._lock = threading.RLock()
        self._by_id: dict[str, _Transfer] = {}
        self._tids = iter(range(1, 1 << 62))
        # Decode side, touched only on that replica's loop thread:
        self._reservations: list[dict[str, _Reservation]] = [{} for _ in replica_set.replicas]
        self._queues: list[collections.deque] = [collections.deque()
                                                 for _ in replica_set.replicas]
        self._copiers: dict[tuple[int, int], PageCopier] = {}
        self._scatters: dict[int, object] = {}
        self.stale_writes = 0           # writes that found their reservation gone
        self.records: list[TransferRecord] = []
        self._record_of: dict[int, TransferRecord] = {}
        self._stop = threading.Event()
        if config.sweep_interval_s is not None:
            threading.Thread(target=self._sweep_forever, daemon=True,
                             name="medha-kv-transfers").start()

    # ------------------------------------------------------------------ any thread

    def begin(self, stream, prefill: int, decode: int, *, start_now: bool = False,
              prefill_s: float | None = None) -> None:
        """Starts the hand-off of a new request: the handshake with `decode`. start_now:
        the request joins `prefill`'s loop at once (a mixed replica, which can decode it
        itself if the grant comes after its prefill); else once `decode` reserved its
        pages. prefill_s: the router's predicted prefill seconds (ServingLoop.add). Raises
        RuntimeError, with nothing begun, when `prefill`'s loop refuses it."""
        request = stream.request
        page_size = self.set.page_size
        t = _Transfer(stream, list(request.prompt_token_ids), prefill, decode,
                      next(self._tids), request.prompt_len // page_size, time.monotonic(),
                      started=start_now)
        with self._lock:
            self._by_id[t.request_id] = t
        if start_now:
            try:
                self.set.replicas[prefill].loop.add(stream, prefill_s=prefill_s)
            except RuntimeError:
                with self._lock:
                    self._drop(t)
                raise
        self._post_handshake(t)

    def cancel(self, request_id: str) -> bool:
        """A client cancel of a request between loops (handshake, rehoming)."""
        with self._lock:
            t = self._by_id.get(request_id)
            if t is None or t.state not in ("handshake", "rehoming"):
                return False
            in_prefill_loop = t.started and t.state == "handshake"
            self._drop(t)
        self._release_reservation(t, register_landed=False)     # if granted meanwhile
        self._release_hold(t)
        if in_prefill_loop:
            return False                  # the prefill loop holds its stream and ends it
        self.set.end_stream(t.stream, "cancelled")
        return True

    def take_back(self, stream, down: int) -> bool:
        """A replica gave `stream` away (it went down or its step failed). True when the
        hand-off keeps it: the decode side died before acknowledging and the prefill side
        still holds the pages (they go to another decode replica). When the prefill side
        died mid-transfer the decode side keeps what arrived as prefix cache; False: the
        replica set re-runs the request."""
        with self._lock:
            t = self._by_id.get(stream.request_id)
            if t is None:
                return False
            if t.state in ("handing", "rehoming") and t.decode == down and t.hold:
                self._rehome(t)
                return True
            before = t.state
            self._drop(t)
        if before in ("handshake", "streaming") or t.prefill == down:
            self._release_reservation(t, register_landed=True)
        self._release_hold(t)
        return False

    def replica_down(self, replica: int) -> None:
        """On the dead replica's loop thread (its on_down): returns what the hand-offs hold
        in its pool (reservations, handshakes waiting there, holds) to that pool."""
        allocator = self.set.replicas[replica].engine.allocator
        for res_id in list(self._reservations[replica]):
            del self._reservations[replica][res_id]
            free_if_held(allocator, res_id)
        self._queues[replica].clear()
        with self._lock:
            held = [t for t in self._by_id.values() if t.prefill == replica and t.hold]
            for t in held:
                if t.state == "handing":          # the decode side has everything: done
                    self._drop(t)
        for t in held:
            hold, t.hold = t.hold, None
            free_if_held(allocator, hold)

    def close(self) -> None:
        self._stop.set()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._by_id)

    def incoming_contexts(self, replica: int) -> tuple[int, ...]:
        """The prompt lengths of the decodes on their way to `replica` (not yet running
        there): the offload decision counts them in its decode batch, else offloads decided
        during one long prefill all see the same idle replica and pile onto it."""
        with self._lock:
            return tuple(len(t.tokens) for t in self._by_id.values()
                         if t.decode == replica and t.state not in ("done", "aborted"))

    # ------------------------------------------------------------------ handshake (decode thread)

    def _post_handshake(self, t: _Transfer) -> None:
        tid = t.tid
        self.set.replicas[t.decode].loop.call(lambda: self._enqueue(t.decode, t, tid))

    def _enqueue(self, decode: int, t: _Transfer, tid: int) -> None:
        self._queues[decode].append((t, tid))
        self._admit(decode)

    def _admit(self, decode: int) -> None:
        """Grants queued handshakes in arrival order: the head waits for pages, and none
        behind it passes it."""
        queue, allocator = self._queues[decode], self.set.replicas[decode].engine.allocator
        ps = allocator.page_size
        while queue:
            t, tid = queue[0]
            with self._lock:
                live = t.tid == tid and t.state in ("handshake", "rehoming")
            if not live:
                queue.popleft()
                continue
            res_id = reservation_id(t.request_id, tid)
            tokens = t.tokens[:t.num_pages * ps + 1]
            reused = allocator.allocate(res_id, tokens)
            if not allocator.reserve(res_id, len(t.tokens)):
                allocator.free(res_id)
                return
            queue.popleft()
            with self._lock:
                granted = t.tid == tid and t.state in ("handshake", "rehoming")
                if granted:
                    t.start = t.sent = reused // ps
                    rehoming, t.state = t.state == "rehoming", (
                        "rehoming" if t.state == "rehoming" else "streaming")
            if not granted:
                allocator.free(res_id)
                continue
            self._reservations[decode][res_id] = _Reservation(t.request_id, t.tokens,
                                                              reused // ps)
            prefill_loop = self.set.replicas[t.prefill].loop
            if rehoming:
                prefill_loop.call(lambda t=t, tid=tid: self._ship_held(t, tid))
                continue
            if t.started:        # prefilling already: its full pages go after its next step
                continue
            try:
                prefill_loop.add(t.stream)
            except RuntimeError:                   # the prefill side is gone meanwhile
                with self._lock:
                    self._drop(t)
                allocator.free(res_id)
                del self._reservations[decode][res_id]
                self.set.rerun(t.stream, f"replica {t.prefill} went away before the prefill")

    # ------------------------------------------------------------------ prefill side

    def after_step(self, replica: int) -> None:
        """Prefill loop thread, after each step: moves the pages that became full."""
        with self._lock:
            mine = [t for t in self._by_id.values()
                    if t.prefill == replica and t.state == "streaming"]
        allocator = self.set.replicas[replica].engine.allocator
        for t in mine:
            request = t.stream.request
            if request.state is RequestState.FINISHED and request.request_id == t.request_id \
                    and len(request.output_token_ids) == 0:
                self._abort(t)                     # cancelled or failed before its first token
                continue
            if not self.config.stream_chunks or not allocator.has(t.request_id):
                continue
            full = min(request.num_computed_tokens // allocator.page_size, t.num_pages)
            if full > t.sent:
                self._ship(t, t.request_id, t.sent, full)
                t.sent = full

    def on_prefilled(self, replica: int, stream) -> bool:
        """Prefill loop thread: the request has its first token. Sends what is left, pins
        the pages and hands the stream to the decode side. False: not handed off here."""
        with self._lock:
            t = self._by_id.get(stream.request_id)
            if t is None or t.prefill != replica or t.stream is not stream:
                return False
            if t.state == "handshake" and t.started:
                # Prefilled before the decode side granted the pages: decode here (plan
                # (a)); the handshake, dropped, frees its reservation if granted later.
                self._drop(t)
                return False
            if t.state != "streaming":
                return False
        from serving.replicas import handed_off_request

        allocator = self.set.replicas[replica].engine.allocator
        ps = allocator.page_size
        # Every page left, the prompt's partial last one too: the decode side then takes
        # them all and computes only the first token (a decode step), not the partial
        # page again (a prefill chunk, a whole query block on some engines).
        prompt_pages = allocator.pages_needed(len(t.tokens))
        if t.sent < prompt_pages:
            self._ship(t, t.request_id, t.sent, prompt_pages)
            t.sent = prompt_pages
        t.whole_prompt_tid = t.tid
        record = self._record_of.get(t.tid)
        if record is not None:
            record.prefilled = time.perf_counter()
            record.prefill_cached_tokens = stream.request.num_cached_tokens
        hold = f"kv-out:{t.request_id}:{t.tid}"
        allocator.allocate(hold, t.tokens[:t.num_pages * ps + 1])
        t.hold = hold
        t.resumed = handed_off_request(stream.request, stream.generated)
        with self._lock:
            decode_ok = self.set.replicas[t.decode].loop.healthy
            if not decode_ok:
                t.failed_decodes.add(t.decode)
                self._rehome(t)
                return True
        self._hand(t, t.tid)
        return True

    def _ship(self, t: _Transfer, source_id: str, lo: int, hi: int) -> None:
        """Prefill loop thread: starts moving pages [lo, hi) of `source_id`'s table (the
        request, or its hold) to the decode side's reservation."""
        if hi <= lo:
            return
        source = self.set.replicas[t.prefill].engine
        ids = global_pages(source.allocator, source_id)[lo:hi]
        copier = self._copier(t.prefill, t.decode)
        chunk = copier.read(ids)
        now = time.perf_counter()
        record = self._record_of.get(t.tid)
        if record is None:
            record = TransferRecord(t.request_id, t.prefill, t.decode, 0, t.start, 0, now,
                                    now, 0.0)
            self._record_of[t.tid] = record
        record.pages_moved += hi - lo
        record.bytes_moved += (hi - lo) * page_bytes(source)
        record.last_send = now
        res_id, decode = reservation_id(t.request_id, t.tid), t.decode
        self.set.replicas[decode].loop.call(
            lambda: self._land(decode, copier, res_id, lo, hi, chunk))

    def _ship_held(self, t: _Transfer, tid: int) -> None:
        """Prefill loop thread: a new decode side granted a re-homed request's pages: move
        them all from the hold, then hand over."""
        with self._lock:
            if t.tid != tid or t.state != "rehoming" or t.hold is None:
                return
        self._ship(t, t.hold, t.start, t.num_pages)
        t.sent = t.num_pages
        self._hand(t, tid)

    def _hand(self, t: _Transfer, tid: int) -> None:
        """Any thread with the pages sent: the decode side registers them, then runs the
        request; it acknowledges to the prefill side. With every prompt page sent to this
        reservation, the request takes the reservation's pages and computes only its
        first token there; else (pages re-homed from the hold, which pins only full
        pages) it takes the full pages from the prefix cache and computes the prompt's
        partial last page again."""
        decode = t.decode
        loop = self.set.replicas[decode].loop
        with self._lock:
            if t.tid != tid:
                return
            t.state, t.handed_at = "handing", time.monotonic()
            t.stream.resume(t.resumed, decode)
        whole = t.whole_prompt_tid == tid
        loop.call(lambda: self._register(decode, t, tid, whole))
        try:
            loop.add(t.stream, kv_from=(reservation_id(t.request_id, tid), len(t.tokens))
                     if whole else None)
        except RuntimeError:
            with self._lock:
                if t.tid == tid:
                    t.failed_decodes.add(decode)
                    self._rehome(t)

    def _ack(self, t: _Transfer, tid: int) -> None:
        """Prefill loop thread: the decode side has the pages: drop the hold (they stay in
        this replica's prefix cache)."""
        with self._lock:
            if t.tid != tid:
                return
            self._drop(t)
            t.state = "done"
        self._release_hold(t)

    # ------------------------------------------------------------------ decode side

    def _land(self, decode: int, copier: PageCopier, res_id: str, lo: int, hi: int,
              chunk) -> None:
        res = self._reservations[decode].get(res_id)
        allocator = self.set.replicas[decode].engine.allocator
        if res is None or not allocator.has(res_id):
            self.stale_writes += 1                  # its transfer is gone: write nothing
            return
        ids = global_pages(allocator, res_id)[lo:hi]
        copier.write(ids, chunk)
        if lo <= res.landed:
            res.landed = max(res.landed, hi)

    def _register(self, decode: int, t: _Transfer, tid: int, whole_prompt: bool) -> None:
        """Decode loop thread, after every page of the transfer landed (its writes came
        first in this loop's inbox): the full pages enter the prefix cache under the
        prompt's page hashes, and the reservation pins them until the request takes them
        (whole_prompt: the add that follows hands it the reservation itself)."""
        allocator = self.set.replicas[decode].engine.allocator
        res_id = reservation_id(t.request_id, tid)
        res = self._reservations[decode].get(res_id)
        if res is not None:
            allocator.commit(res_id, res.tokens,
                             min(res.landed * allocator.page_size, len(res.tokens)))
            if whole_prompt and res.landed < allocator.pages_needed(len(res.tokens)):
                # A page is missing (never expected: writes land in order): the request
                # must not take pages without their K/V; it computes past the cache.
                allocator.free(res_id)
            res.waits_for = t.resumed
            record = self._record_of.pop(tid, None)
            if record is not None:
                record.registered = time.perf_counter()
                self.records.append(record)
        self._settle(decode)
        prefill_loop = self.set.replicas[t.prefill].loop
        prefill_loop.call(lambda: self._ack(t, tid))

    def _settle(self, decode: int) -> None:
        """Decode loop thread: frees reservations whose request took the pages (or ended),
        and grants waiting handshakes."""
        allocator = self.set.replicas[decode].engine.allocator
        for res_id, res in list(self._reservations[decode].items()):
            request = res.waits_for
            if request is None:
                continue
            taken = not allocator.has(res_id)     # by the request (kv_from), or freed
            if taken or allocator.has(request.request_id) \
                    or request.state is not RequestState.WAITING:
                if not taken:
                    allocator.free(res_id)
                del self._reservations[decode][res_id]
        self._admit(decode)

    def after_decode_step(self, replica: int) -> None:
        """Decode loop thread, after each step."""
        if self._reservations[replica] or self._queues[replica]:
            self._settle(replica)

    def _release_reservation(self, t: _Transfer, register_landed: bool) -> None:
        res_id, decode = reservation_id(t.request_id, t.tid), t.decode

        def release():
            res = self._reservations[decode].pop(res_id, None)
            if res is None:
                return
            allocator = self.set.replicas[decode].engine.allocator
            if not allocator.has(res_id):         # the request took them (kv_from)
                self._admit(decode)
                return
            if register_landed and res.landed:
                allocator.commit(res_id, res.tokens,
                                 min(res.landed * allocator.page_size, len(res.tokens)))
            allocator.free(res_id)
            self._admit(decode)
        self._on_loop(decode, release)

    # ------------------------------------------------------------------ faults, timeouts

    def _rehome(self, t: _Transfer) -> None:
        """Under the lock, the prefill side holding the pages: hands them to another
        decode replica (a new transfer id), or when none is left, decodes where they are."""
        old_decode, old_tid = t.decode, t.tid
        if self.set.replicas[old_decode].loop.healthy and t.state in ("handing", "rehoming"):
            t.failed_decodes.add(old_decode)
        choice = self.set.decode_target(t.prefill, exclude=t.failed_decodes | {t.prefill})
        t.tid = next(self._tids)
        if old_tid != t.tid:
            self._release_reservation(dataclasses.replace(t, tid=old_tid, decode=old_decode),
                                      register_landed=False)
        if choice is None:
            t.decode = t.prefill
            self._hand(t, t.tid)                 # decode where the pages are (hold released on ack)
            return
        t.decode, t.state, t.created = choice, "rehoming", time.monotonic()
        self._post_handshake(t)

    def _abort(self, t: _Transfer) -> None:
        with self._lock:
            if self._by_id.get(t.request_id) is not t:
                return
            self._drop(t)
        self._release_reservation(t, register_landed=False)
        self._release_hold(t)

    def _drop(self, t: _Transfer) -> None:
        if self._by_id.get(t.request_id) is t:
            del self._by_id[t.request_id]
        t.state = "aborted" if t.state != "done" else t.state

    def _release_hold(self, t: _Transfer) -> None:
        hold, t.hold = t.hold, None
        if hold is not None:
            allocator = self.set.replicas[t.prefill].engine.allocator
            self._on_loop(t.prefill, lambda: free_if_held(allocator, hold))

    def _sweep_forever(self) -> None:
        while not self._stop.wait(self.config.sweep_interval_s):
            try:
                self.sweep(time.monotonic())
            except Exception:
                logger.exception("KV transfer sweep failed")

    def sweep(self, now: float) -> None:
        """Timeouts and ends the loops did not report (client cancels, dead replicas)."""
        config = self.config
        fallback, aborts, unpinned, settle = [], [], [], set()
        with self._lock:
            for t in list(self._by_id.values()):
                request = t.stream.request
                if t.state == "handshake" and t.started and (
                        now - t.created > config.handshake_timeout_s
                        or request.state is RequestState.FINISHED):
                    aborts.append(t)   # it is served where it prefills: nothing to re-run
                elif t.state == "handshake" and now - t.created > config.handshake_timeout_s:
                    self._drop(t)
                    fallback.append(t)
                elif t.state == "streaming" and (
                        now - t.created > config.transfer_timeout_s
                        or (request.state is RequestState.FINISHED and not request.output_token_ids)
                        or not self.set.replicas[t.prefill].loop.healthy):
                    aborts.append(t)
                elif t.state == "handing" and now - t.handed_at > config.ack_timeout_s:
                    self._drop(t)
                    unpinned.append(t)
                elif t.state == "rehoming" and not self.set.replicas[t.prefill].loop.healthy:
                    self._drop(t)
                    fallback.append(t)
                if t.state in ("handing", "done"):
                    settle.add(t.decode)
        for t in unpinned:
            self._release_hold(t)
        for t in aborts:
            self._abort(t)
        for t in fallback:
            self._release_reservation(t, register_landed=False)
            self.set.rerun(t.stream, "the KV hand-off timed out", colocated=t.prefill)
        # Reservations a decode request has taken (or that it will never take: cancelled
        # there before its first step) are freed even when that loop runs no more steps.
        waiting = {d for d, q in enumerate(self._queues) if q}
        holding = {d for d, r in enumerate(self._reservations) if r}
        for decode in waiting | holding | settle:
            self.set.replicas[decode].loop.call(lambda d=decode: self._settle(d))

    def _on_loop(self, replica: int, fn) -> None:
        """Runs fn on the replica's loop thread; on a loop that went down, here once its
        thread has ended (nothing else touches its allocator then), so a dead replica's
        pool is returned too."""
        loop = self.set.replicas[replica].loop
        if loop.call(fn) or loop.closing:
            return
        if threading.current_thread() is loop.thread or not loop.thread.is_alive():
            fn()
            return

        def after_the_thread():                   # not under our lock: it may be waiting on it
            loop.thread.join()
            fn()
        threading.Thread(target=after_the_thread, daemon=True).start()

    def warmup(self) -> int:
        """Compiles every replica's page gather and scatter (each padded page count up to a
        whole prompt's pages) before any request: the first hand-offs would otherwise
        wait for those compiles. Returns the shapes compiled."""
        count = 0
        for i, replica in enumerate(self.set.replicas):
            engine = replica.engine
            if engine.kv_cache is None or engine.cp_ranks > 1:
                continue
            count += warm_up(engine, self._scatter_of(i),
                             engine.allocator.pages_needed(engine.max_model_len))
        return count

    def _scatter_of(self, replica: int):
        scatter = self._scatters.get(replica)
        if scatter is None:
            scatter = self._scatters[replica] = page_scatter(self.set.replicas[replica].engine)
        return scatter

    def _copier(self, source: int, destination: int) -> PageCopier:
        key = (source, destination)
        copier = self._copiers.get(key)
        if copier is None:
            copier = self._copiers[key] = PageCopier(
                self.set.replicas[source].engine, self.set.replicas[destination].engine,
                self._scatter_of(destination))
        return copier


def reservation_id(request_id: str, tid: int) -> str:
    return f"kv-in:{request_id}:{tid}"


def global_pages(allocator, owner: str) -> np.ndarray:
    """The owner's pages as ids into the engine's whole cache (shard-major), token order."""
    return np.concatenate([seg.shard * allocator.pages_per_shard + seg.table.astype(np.int64)
                           for seg in allocator.segments(owner)] or [np.zeros(0, np.int64)])


def page_bytes(engine) -> int:
    """Bytes of one page of K and V over every layer (0 before the cache exists)."""
    if engine.kv_cache is None:
        return 0
    k = engine.kv_cache.k
    return 2 * k.shape[0] * k.shape[2] * k.shape[3] * k.dtype.itemsize
