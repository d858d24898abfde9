"""Prefill on one Ray replica actor, decode on another: the replica actors' side of the KV
hand-off (seeds 001 and 003). serving.kv_transfer runs the same protocol between the
replicas of one process; here each side is a process of its own (serving.ray_cluster's
ReplicaActor) and the front (RayServer) carries every message, so only it talks to both:

    front                          decode actor D                prefill actor P
    reserve(id, tid, prompt) -----> books every full prompt page
                                    (handshakes in arrival order)
          <------------------------ granted: the pages D had cached
    prefill(id, prompt, ...) ----------------------------------> prefills; after each step
          <---------------------------------------------------- PagesOffered(wire, lo, hi)
    land(res, wire, lo, hi) ------> pulls them (serving.kv_wire), writes
          <---------------------------------------------------- first token, HandedOff
                                                                  (P pins its pages: a hold)
    register(res) ----------------> the full pages enter D's prefix cache under the
                                    prompt's page hashes (seed 003 H6)
    generate(prompt + token, res) -> takes the reservation's pages (every prompt page
                                    landed, the partial last one too: P offers it with
                                    the first token) and computes only the first token,
                                    a decode step; else by prefix reuse, the partial
                                    page again
    release_hold(id) ------------------------------------------> unpins (they stay cached)

A mixed prefill actor (one that can decode) starts the prefill at once, beside the
reserve, so the handshake's wait is not in the TTFT: its prefill offers nothing until the
front passes on the grant (`grant`, the pages D has cached), and a first token sampled
before then stays, the request decoding on P (serving.kv_transfer's start_now). A
prefill-role actor, which cannot decode, prefills once the grant is known.

Order: an async actor runs calls in no set order, so the front waits for each call whose
order matters (every land before register, register before the decode's generate, and after
a prefill actor died, the release that registers what landed before the re-run).

Ids: the front names a request by its own id; inside an actor the request has the id its
Server gave it (`bind` ties the two), which is what the loop and the allocator know.

Ownership: a reservation is the allocator id `kv-in:{request}:{tid}` (serving.kv_transfer's
reservation_id); a land names it and writes nothing once it is gone (cancelled, timed out),
so a stale transfer can never reach pages that now belong to another request.

Faults, decided by the front from which call raised: P dies mid-transfer: D registers what
landed and frees the rest, and the request re-runs (the router sends it where those pages
are, so only what did not arrive is recomputed). D dies before registering: P still holds the
pages, so the request decodes on P, which takes them by prefix reuse (no re-prefill).
Timeouts (DisaggConfig, swept on the loop thread after each step and on the front's polls):
a reservation not registered within transfer_timeout_s, or registered and not taken within
ack_timeout_s, is freed; a hold not released within ack_timeout_s is dropped; the front gives
a handshake not granted within handshake_timeout_s back to co-located serving.

A running decode moves the same way, later (medha_jax.cluster.offload's choose_move):

    move_out(id) -----------------------------------------------> at the request's next
                                                                  token: every page of
                                                                  what it computed offered,
          <---------------------------------------------------- Moved(wire, tokens);
                                                                  released here (its full
                                                                  pages stay cached)
    generate(prompt + outputs, ..., moved=(tid, computed, wire))
                               -> pulls them; in the loop turn that adds the request,
                                  books them, writes those not cached here and
                                  registers them (`take_moved`); the request takes them
                                  whole: its first step is a decode step

If D cannot book them it computes what it does not hold; if D is down the request re-runs
on P from its cached full pages.

Pages move per chunk, after the step that computed them (not per layer: the layers of a step
run as one scanned program), as in serving.kv_transfer. Pulls run off the loop thread; only
the write into the cache runs on it.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

import numpy as np

from medha_jax.kv_cache.allocator import free_if_held
from medha_jax.request import RequestState
from serving.kv_copy import page_scatter, warm_up
from serving.kv_transfer import DisaggConfig, global_pages, reservation_id
from serving.kv_wire import PageReceiver, PageSender, WireChunk
from serving.outputs import RequestMetrics


@dataclasses.dataclass(frozen=True)
class PagesOffered:
    """An item of a prefill stream: the prompt's pages [lo, hi) are offered for pulling."""

    wire: WireChunk
    lo: int
    hi: int
    finished: bool = False        # (a stream item; RequestHandle counts finals)


@dataclasses.dataclass(frozen=True)
class HandedOff:
    """The last item of a prefill stream whose decode goes on elsewhere: its first token
    went out in the delta before it; metrics: the prefill side's (TTFT, cached tokens)."""

    metrics: RequestMetrics
    finished: bool = True


@dataclasses.dataclass(frozen=True)
class Moved:
    """The last item of a generate stream whose decode moves on (`move_out`): every page
    of its first `computed` tokens (prompt and outputs; the last output's K/V is not
    computed yet) is offered as `wire`; metrics: this side's (TTFT, cached tokens)."""

    wire: WireChunk
    computed: int
    metrics: RequestMetrics
    finished: bool = True


@dataclasses.dataclass
class _Outgoing:
    internal: str                 # the request's id in this replica
    push: Callable                # puts an item in the request's stream (any thread)
    tokens: list[int]
    num_pages: int                # full prompt pages the decode side needs
    sent: int | None              # pages [.., sent) offered (from the first not cached
                                  # there); None until the decode side's grant is known
    hold: str | None = None
    held_at: float = 0.0
    taker: str | None = None      # a re-run here that takes the held pages (decode side died)


@dataclasses.dataclass
class _Incoming:
    request_id: str               # the front's
    tokens: list[int]
    num_pages: int                # full prompt pages
    created: float
    granted: Callable | None      # resolves the front's reserve() call, until granted
    landed: np.ndarray | None = None      # per prompt page, the partial one too: written here
                                          # (or cached here)
    registered_at: float | None = None
    taker: str | None = None      # the request here that takes the pages (`bind`)

    @property
    def landed_prefix(self) -> int:
        """Leading full pages landed (what may enter the prefix cache)."""
        if self.landed is None:
            return 0
        missing = np.flatnonzero(~self.landed[:self.num_pages])
        return int(missing[0]) if len(missing) else self.num_pages


class ReplicaHandoffs:
    """Both sides of one replica actor's hand-offs (see the module's docstring). Its state
    is touched only on the replica's loop thread, except `pull`."""

    def __init__(self, replica, config: DisaggConfig):
        self.replica, self.config = replica, config
        self.engine = replica.engine
        self._outgoing: dict[str, _Outgoing] = {}     # the front's request id -> its prefill
        self._front_id: dict[str, str] = {}           # this replica's request id -> front's
        self._incoming: dict[str, _Incoming] = {}     # reservation id -> its booking
        self._queue: collections.deque[str] = collections.deque()   # arrival order
        # The front's request id -> (pages the decode side has cached, when it came), for
        # prefills started before the grant; written from any thread (`grant`).
        self._grants: dict[str, tuple[int, float]] = {}
        # This replica's request id -> (the front's id, its stream's push): decodes that
        # move on at their next token (`move_out`).
        self._moving: dict[str, tuple[str, Callable]] = {}
        self._sender: PageSender | None = None
        self._receiver: PageReceiver | None = None
        self._scatter = page_scatter(self.engine)      # the receiver's writes, warmed up once
        self.stale_writes = 0
        self.taken_whole = 0          # reservations their request took as its own pages
        replica.loop.on_prefilled = self._on_prefilled
        replica.loop.publishes_decode_contexts = True     # the front's offload decision
        replica.step_hooks.append(lambda: self.sweep(time.monotonic()))

    def warm_up(self) -> int:
        """Loop thread, before any request: compiles the page gather and write of every
        padded page count up to a whole prompt's pages. Returns the shapes compiled."""
        engine = self.engine
        return warm_up(engine, self._scatter, engine.allocator.pages_needed(engine.max_model_len))

    # ------------------------------------------------------------------ prefill side

    def expect(self, request_id: str, internal: str, tokens: list[int],
               start_page: int | None, num_pages: int, push: Callable) -> None:
        """The request (added just before as `internal`) hands its decode off: offer its
        full prompt pages from start_page (those before it the decode side has cached) as
        they fill, and the partial last one with the first token. start_page None (a mixed
        replica, which started the prefill before the decode side granted the pages):
        nothing is offered until `grant` gives it, and a first token sampled before that
        stays here (the request decodes here, as serving.kv_transfer's start_now)."""
        self._outgoing[request_id] = _Outgoing(internal, push, tokens, num_pages, start_page)
        self._front_id[internal] = request_id

    def grant(self, request_id: str, start_page: int) -> None:
        """Any thread: the decode side granted the pages of a prefill started before it,
        start_page of them cached there. Read on the loop thread at the next step's end."""
        self._grants[request_id] = (start_page, time.monotonic())

    def _granted(self, request_id: str, out: _Outgoing) -> bool:
        """Whether out's pages may be offered (its grant known), taking a grant that came."""
        if out.sent is None and request_id in self._grants:
            out.sent = self._grants.pop(request_id)[0]
        return out.sent is not None

    def _ship_filled(self) -> None:
        ps = self.engine.allocator.page_size
        for request_id, out in list(self._outgoing.items()):
            if out.hold is not None:
                continue
            request = self.replica.controller.get(out.internal)
            if request is None or request.state is RequestState.FINISHED:
                self._forget(request_id)           # ended before its first token
                continue
            if (self.config.stream_chunks and self._granted(request_id, out)
                    and self.engine.allocator.has(out.internal)):
                full = min(request.num_computed_tokens // ps, out.num_pages)
                self._offer(out, out.internal, full)

    def _offer(self, out: _Outgoing, owner: str, hi: int) -> None:
        if hi <= out.sent:
            return
        ids = global_pages(self.engine.allocator, owner)[out.sent:hi]
        out.push(PagesOffered(self._send(ids), out.sent, hi))
        out.sent = hi

    def _send(self, page_ids: np.ndarray) -> WireChunk:
        if self._sender is None:
            self._sender = PageSender(self.engine)
        return self._sender.send(page_ids)

    def move_out(self, request_id: str, internal: str, push: Callable) -> bool:
        """The front moves the decode of its request `request_id` (here `internal`) to
        another replica: at its next token every page it computed is offered and it ends
        here with Moved (`_on_prefilled`). False when it is not decoding here."""
        request = self.replica.controller.get(internal)
        if (request is None or request.state is RequestState.FINISHED
                or not request.output_token_ids or request_id in self._outgoing):
            return False
        self._moving[internal] = (request_id, push)
        self.replica.loop.moving.add(internal)
        return True

    def _move_out(self, stream, request_id: str, push: Callable) -> bool:
        request = stream.request
        computed = request.num_computed_tokens
        ids = global_pages(self.engine.allocator, request.request_id)[
            :self.engine.allocator.pages_needed(computed)]
        push(Moved(self._send(ids), computed, RequestMetrics.from_request(request)))
        return True

    def _on_prefilled(self, stream) -> bool:
        """The loop's hook at the first token: offers what is left, pins the pages and ends
        the stream with HandedOff (the loop then releases the request here)."""
        moving = self._moving.pop(stream.request_id, None)
        if moving is not None:
            self.replica.loop.moving.discard(stream.request_id)
            return self._move_out(stream, *moving)
        request_id = self._front_id.get(stream.request_id)
        out = self._outgoing.get(request_id)
        if out is None or out.hold is not None:
            return False
        if not self._granted(request_id, out):       # the grant is late: decode here
            self._forget(request_id)
            return False
        allocator = self.engine.allocator
        self._offer(out, out.internal, allocator.pages_needed(len(out.tokens)))   # partial too
        hold = f"kv-out:{request_id}"
        allocator.allocate(hold, out.tokens[:out.num_pages * allocator.page_size + 1])
        out.hold, out.held_at = hold, time.monotonic()
        out.push(HandedOff(RequestMetrics.from_request(stream.request)))
        return True

    def release_hold(self, request_id: str) -> None:
        out = self._forget(request_id)
        if out is not None and out.hold is not None:
            free_if_held(self.engine.allocator, out.hold)

    def _forget(self, request_id: str) -> _Outgoing | None:
        out = self._outgoing.pop(request_id, None)
        self._grants.pop(request_id, None)
        if out is not None:
            self._front_id.pop(out.internal, None)
        return out

    # ------------------------------------------------------------------ decode side

    def reserve(self, request_id: str, tid: int, tokens: list[int],
                granted: Callable[[int | None], None]) -> None:
        """Queues the handshake; `granted(pages cached here)` once every prompt page (the
        partial last one too) is booked, or granted(None) when it is withdrawn first."""
        res_id = reservation_id(request_id, tid)
        self._incoming[res_id] = _Incoming(request_id, list(tokens),
                                           len(tokens) // self.engine.allocator.page_size,
                                           time.monotonic(), granted)
        self._queue.append(res_id)
        self._admit()

    def _admit(self) -> None:
        """Grants queued handshakes in arrival order: the head waits for pages and none
        behind it passes it."""
        while self._queue:
            res_id = self._queue[0]
            res = self._incoming.get(res_id)
            if res is None:                        # withdrawn
                self._queue.popleft()
                continue
            cached = self._book(res_id, res)
            if cached is None:
                return
            self._queue.popleft()
            granted, res.granted = res.granted, None
            granted(cached)

    def _book(self, res_id: str, res: _Incoming) -> int | None:
        """Books every page of res.tokens under res_id, taking those cached here; the
        pages cached here, or None (nothing kept) when the rest are not free now."""
        allocator = self.engine.allocator
        ps = allocator.page_size
        reused = allocator.allocate(res_id, res.tokens[:res.num_pages * ps + 1])
        if not allocator.reserve(res_id, len(res.tokens)):
            allocator.free(res_id)
            return None
        res.landed = np.arange(allocator.pages_needed(len(res.tokens))) < reused // ps
        return reused // ps

    def take_moved(self, request_id: str, tid: int, tokens: list[int], chunk) -> str | None:
        """Loop thread, just before the moved request's add: its pages (every page of
        `tokens`, pulled as `chunk`) booked, written where not cached here and registered;
        the reservation id the request takes them by (`kv_from`), or None (nothing kept:
        it computes them) when the pages are not free now. It does not queue behind
        handshakes: its pages were in use on its replica, where it already decodes."""
        res_id = reservation_id(request_id, tid)
        res = _Incoming(request_id, list(tokens), len(tokens) // self.engine.allocator.page_size,
                        time.monotonic(), None)
        if self._book(res_id, res) is None:
            return None
        self._incoming[res_id] = res
        self.land(res_id, chunk, 0, len(res.landed))
        self.register(res_id)
        return res_id

    def pull(self, wire: WireChunk):
        """Any thread: the offered pages on this replica's devices."""
        if self._receiver is None:
            self._receiver = PageReceiver(self.engine, scatter=self._scatter)
        return self._receiver.pull(wire)

    def land(self, res_id: str, chunk, lo: int, hi: int) -> bool:
        """Writes pulled pages [lo, hi) into the reservation; False (nothing written) when
        it is gone."""
        res = self._incoming.get(res_id)
        if res is None or res.landed is None or res.registered_at is not None:
            self.stale_writes += 1
            return False
        ids = global_pages(self.engine.allocator, res_id)[lo:hi].copy()
        # Pages cached here already (a moved decode's offer starts at page 0) may be
        # shared with other requests: an out-of-range id drops that page's write.
        ids[res.landed[lo:hi]] = self.engine.kv_cache.num_pages
        self._receiver.writer.write(ids, chunk)
        res.landed[lo:hi] = True
        return True

    def register(self, res_id: str) -> bool:
        """The landed pages enter the prefix cache; the reservation pins them until the
        request takes them. False when the reservation is gone."""
        res = self._incoming.get(res_id)
        if res is None or res.landed is None:
            return False
        allocator = self.engine.allocator
        allocator.commit(res_id, res.tokens, res.landed_prefix * allocator.page_size)
        res.registered_at = time.monotonic()
        return True

    def whole_prompt(self, res_id: str) -> tuple[str, int] | None:
        """Any thread, after register(res_id) returned: (res_id, prompt tokens) when every
        prompt page landed there, what the decode request takes as its own pages
        (`ReplicaController.add_request`'s kv_from); None: it takes the full pages by
        prefix reuse."""
        res = self._incoming.get(res_id)
        if res is None or res.registered_at is None or not res.landed.all():
            return None
        return res_id, len(res.tokens)

    def release_reservation(self, res_id: str, register_landed: bool = False) -> None:
        res = self._incoming.pop(res_id, None)
        if res is None:
            return
        allocator = self.engine.allocator
        if res.granted is not None:
            res.granted(None)
        elif not allocator.has(res_id):
            self.taken_whole += res.registered_at is not None    # the request took them
        else:
            if register_landed and res.registered_at is None and res.landed_prefix:
                allocator.commit(res_id, res.tokens, res.landed_prefix * allocator.page_size)
            allocator.free(res_id)
        self._admit()

    # ------------------------------------------------------------------ both

    def bind(self, request_id: str, internal: str) -> None:
        """The front's request `request_id` runs here now as `internal`: once that request
        holds the pages it was handed (by prefix reuse), the reservation or hold that kept
        them for it goes."""
        for res in self._incoming.values():
            if res.request_id == request_id:
                res.taker = internal
        out = self._outgoing.get(request_id)
        if out is not None and out.hold is not None:
            out.taker = internal

    def request_ended(self, request_id: str) -> None:
        """A request of this id ended here: what was kept for it goes."""
        for internal, (moving, _) in list(self._moving.items()):
            if moving == request_id:
                del self._moving[internal]
                self.replica.loop.moving.discard(internal)
        for res_id, res in list(self._incoming.items()):
            if res.request_id == request_id and res.registered_at is not None:
                self.release_reservation(res_id)
        self.release_hold(request_id)

    def sweep(self, now: float) -> None:
        """After each step and on the front's polls: ships filled pages, frees what a
        request took (its own pages now pin them) and what timed out."""
        self._ship_filled()
        allocator, config = self.engine.allocator, self.config
        for res_id, res in list(self._incoming.items()):
            if res.registered_at is not None:
                if (res.taker is not None and allocator.has(res.taker)
                        or now - res.registered_at > config.ack_timeout_s):
                    self.release_reservation(res_id)
            elif now - res.created > config.transfer_timeout_s:
                self.release_reservation(res_id)
        for request_id, out in list(self._outgoing.items()):
            if out.hold is not None and (out.taker is not None and allocator.has(out.taker)
                                         or now - out.held_at > config.ack_timeout_s):
                self.release_hold(request_id)
        # A grant that came after its request stopped handing off (decoded here, ended).
        for request_id, (_, at) in list(self._grants.items()):
            if request_id not in self._outgoing and now - at > config.ack_timeout_s:
                self._grants.pop(request_id, None)

    @property
    def leading_pages_landed(self) -> int:
        """The most leading pages landed of any reservation kept (what a prefill side's
        death would leave in the prefix cache: pulls may end out of order)."""
        return max((res.landed_prefix for res in self._incoming.values()), default=0)

    @property
    def in_flight(self) -> int:
        """Reservations and holds kept (0 once every hand-off settled)."""
        return len(self._incoming) + sum(o.hold is not None for o in self._outgoing.values())
