"""ServingLoop: the one thread that drives a replica's controller and engine.

Threads. The controller and the engine are single-threaded; only the loop thread touches
them. Callers on any thread post "add" and "cancel" commands to an inbox that the loop
drains before every iteration; results flow back through each request's RequestStream.

One iteration: schedule -> engine.dispatch while the engine has room for another batch in
flight (its SPP stages), then engine.collect of the oldest -> update (the controller's two
public steps, execution owned here through medha_jax.scheduler.in_flight), then deliver
the new tokens and their logprobs: detokenization and stop strings (the controller handles
stop token ids, end of sequence and max_tokens), final outputs, Prometheus metrics. An
engine with only `execute` (a test double) runs one batch at a time.

n samples of one prompt (SamplingParams.n) share its prefill through the prefix cache:
sample 0 goes to the controller first; the others are held here and added once sample 0
has its first token, when its prompt's full pages are computed and committed, so they
reuse those pages and compute only the rest of the prompt (at least its last token).
Should sample 0 end before that (cancelled, failed), the held ones end the same way. A
held sample cancelled by its own id ends at once (RequestHandle.cancel names every sample).

Failure containment: an exception in dispatching or collecting a batch, or in applying
its result, fails only that batch's requests (FinishReason.ERROR, the error named) and
the loop keeps serving the rest. When the step failed on the device, the donated KV cache
went with it: the engine rebuilds it, the batches still in flight behind it (which read
the lost cache) are dropped unapplied, and every other request holding pages is
preempted for recompute from its tokens (`Engine.recover_kv_cache`,
`InFlightRunner.abandon`, `ReplicaController.preempt_all`). One in the scheduler itself may have left any request half-updated, so it
fails every request in flight; so does a bug anywhere else in an iteration, rather than
leave callers waiting on a dead thread.

Replica faults (several replicas, `on_down` set): a failed step's requests are handed to
`on_down` to be re-run on another replica (from prompt + the tokens they streamed) instead
of failing; after `max_step_failures` failed steps in a row, or when the loop thread dies,
the replica goes down (`down_reason`; `add` raises ReplicaDown): every request it holds is
released here and handed to `on_down`, and the thread ends.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence

from medha_jax.request import Batch, FinishReason, Request, StepResult, TokenLogprobs
from medha_jax.scheduler.controller import ReplicaController
from medha_jax.scheduler.in_flight import BatchFailed, InFlightRunner
from medha_jax.scheduler.policies import QueuedPrefill, QueuedPrefills
from serving.metrics import ServerMetrics
from serving.outputs import RequestStream
from serving.multihost import ReplicaUnavailable

logger = logging.getLogger(__name__)

# How long an iteration that could run nothing (e.g. pages are short) waits for news.
IDLE_WAIT_S = 0.002
# Failed steps in a row after which a replica with somewhere else to go gives up: one
# failure may be a bad batch (its requests move on), three in a row is a broken device.
MAX_STEP_FAILURES = 3


class ReplicaDown(RuntimeError):
    """The replica stopped serving: its steps kept failing or its loop thread died."""


class ServingLoop:
    """Owns the loop thread, its inbox and the streams of the requests in flight."""

    def __init__(self, controller: ReplicaController, engine, metrics: ServerMetrics,
                 *, name: str = "medha-server-loop", on_step=None, replica: int = 0,
                 decode_token_s: float | None = None,
                 max_step_failures: int = MAX_STEP_FAILURES):
        """engine: a PipelinedExecutor (`dispatch`, `collect`, `max_in_flight`) or anything
        with `execute(batch) -> StepResult`, and an `allocator`.
        on_step: called on the loop thread after each collected step (the server refines
        its runtime predictor there); what it raises is logged, never fails a request.
        replica: this loop's replica in the server (its metrics' label).
        decode_token_s: with several replicas, what a decode token costs: the loop then
        publishes its queued predicted work in `load` for the router (only the loop
        thread may walk the controller's requests).
        max_step_failures: with `on_down` set (see the module's docstring), failed steps in
        a row after which the replica goes down."""
        self.controller, self.engine, self.metrics = controller, engine, metrics
        self.on_step = on_step
        self.replica = replica
        self._decode_token_s = decode_token_s
        # on_down(loop, streams, reason): takes over requests this replica cannot serve
        # (set by serving.replicas.ReplicaSet before any request; None: they fail here).
        self.on_down = None
        # on_prefilled(stream) -> bool: asked when a request has its first token; True
        # when it was handed off (its decode goes on elsewhere: serving.kv_transfer), so
        # this loop releases it here without finishing its stream.
        self.on_prefilled = None
        # Requests (ids here) whose decode moves to another replica at their next token:
        # on_prefilled is asked then too (serving.ray_handoff's move_out).
        self.moving: set[str] = set()
        self.max_step_failures = max_step_failures
        self._step_failures = 0                     # failed steps in a row
        self.down_reason: str | None = None
        # (waiting, running, queued predicted seconds) after the last iteration: what the
        # router reads from other threads (one tuple, replaced whole).
        self.load: tuple[int, int, float] = (0, 0, 0.0)
        # Free KV pages after the last iteration (reservations count as used), likewise.
        self.free_pages: int = engine.allocator.num_free_pages
        # Each request here with prefill left as LARS sees it (QueuedPrefill: its
        # predicted seconds of it, its slack, its whole prefill's seconds, as of the
        # publication): where a new prefill would fall in this queue (the router's
        # predicted TTFT); the sum of their seconds is what slows decodes here (the
        # offload decision, medha_jax.cluster.offload). Requests added and not yet taken
        # from the inbox count with the seconds their add() gave: the loop takes them in
        # only between steps, and a request routed here during a long prefill step was
        # invisible to the next decisions until it ended.
        self.queued_prefills = QueuedPrefills()
        self._taken_prefills = QueuedPrefills()     # the controller's, last published
        # request id -> (its prefill seconds, its TTFT deadline, its prompt's tokens), under
        # _lock
        self._inbox_prefills: dict[str, tuple[float, float, int]] = {}
        self._taken_ids: list[str] = []     # loop thread: added since the last publication
        # The requests here that decode (prefill done, not finished): a prefill's chunks
        # slow each of them (the router prices that).
        self.num_decoding = 0
        # The requests that decode here (one list, replaced whole; `decode_contexts`): the
        # offload decision prices this replica's decode step with them. Published only
        # where a ReplicaSet that moves KV between replicas turns it on.
        self.publishes_decode_contexts = False
        self._decoders: list[Request] = []
        self.runner = InFlightRunner(controller, engine if hasattr(engine, "dispatch")
                                     else _OneAtATime(engine))
        self._lock = threading.Condition()          # guards everything up to _streams
        # ("add", (RequestStream, held RequestStreams, kv_from)) | ("cancel", id) | ("call", fn)
        self._inbox: list[tuple[str, object]] = []
        self._in_flight: set[str] = set()           # request ids submitted and not finished
        self._closing = False
        self._drain_on_close = False
        self._streams: dict[str, RequestStream] = {}  # loop thread only, in the controller
        # Loop thread only: sample 0's id and held samples' ids -> their n-group.
        self._groups: dict[str, _SampleGroup] = {}
        self._observe_state()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    # ------------------------------------------------------------ any thread

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def healthy(self) -> bool:
        """Serving and taking requests (not down, not closing, the thread alive)."""
        return self.down_reason is None and not self._closing and self.thread.is_alive()

    def add(self, stream: RequestStream, held: Sequence[RequestStream] = (), *,
            kv_from: tuple[str, int] | None = None, prefill_s: float | None = None) -> None:
        """Queues a validated request; `held`: the other samples of its prompt (n > 1),
        added once it has its first token (see the module's docstring); kv_from: pages of
        this engine that hold its first tokens' K/V (`ReplicaController.add_request`);
        prefill_s: its predicted prefill seconds here (the router's), published in
        `queued_prefills` until the loop takes it in.
        Raises when an id is in flight or the loop stopped."""
        ids = [stream.request_id, *(h.request_id for h in held)]
        with self._lock:
            if self._closing:
                raise RuntimeError("the server is closed")
            if self.down_reason is not None:
                raise ReplicaDown(f"replica {self.replica} is down: {self.down_reason}")
            taken = [rid for rid in ids if rid in self._in_flight]
            if taken or len(set(ids)) < len(ids):
                raise ValueError(f"request_id {(taken or ids)[0]!r} is already in flight")
            self._in_flight.update(ids)
            self._inbox.append(("add", (stream, tuple(held), kv_from)))
            if prefill_s is not None and self._decode_token_s is not None:
                request = stream.request
                self._inbox_prefills[stream.request_id] = (prefill_s, request.deadline,
                                                           request.prompt_len)
                self.queued_prefills = self._taken_prefills.plus(self._inbox_queued())
            self._lock.notify()

    def cancel(self, request_id: str) -> bool:
        """Asks for the request to be cancelled; False if it is not in flight."""
        with self._lock:
            if request_id not in self._in_flight:
                return False
            self._inbox.append(("cancel", request_id))
            self._lock.notify()
        return True

    def call(self, fn) -> bool:
        """Runs fn() on the loop thread before its next iteration, in order with adds and
        cancels (the KV hand-off writes pages into this engine's cache and books them in
        its allocator, which only this thread touches). False (not queued) once the loop
        stopped or went down; what fn raises is logged."""
        with self._lock:
            if self._closing or self.down_reason is not None:
                return False
            self._inbox.append(("call", fn))
            self._lock.notify()
        return True

    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stops the loop: cancels what is in flight (or with drain=True lets it finish)
        and joins the thread. Idempotent."""
        with self._lock:
            self._closing = True
            self._drain_on_close = drain
            self._lock.notify()
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"the server loop did not stop within {timeout=} s")

    # ------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        try:
            while True:
                try:
                    if not self._iterate():
                        return
                except Exception as e:
                    logger.exception("server loop iteration failed")
                    self._fail(list(self._streams),
                               f"server loop failed: {type(e).__name__}: {e}")
        except BaseException as e:
            # The thread dies (what escaped is no Exception): whatever it held moves on.
            if self.on_down is not None and self.down_reason is None:
                self._go_down(f"its loop thread died: {type(e).__name__}: {e}")
            raise

    def _iterate(self) -> bool:
        """Drains the inbox, then runs one step. False once the loop has stopped."""
        controller = self.controller
        with self._lock:
            while not (self._inbox or self._closing or controller.has_unfinished()):
                self._lock.wait()
            commands, self._inbox = self._inbox, []
            closing, drain = self._closing, self._drain_on_close
        for i, (kind, arg) in enumerate(commands):
            if kind == "call":
                try:
                    arg()
                except Exception:
                    logger.exception("replica %d: a posted call failed", self.replica)
                except BaseException:
                    # The thread dies in it: what is left goes back to the inbox, which
                    # going down hands on (no add is lost).
                    with self._lock:
                        self._inbox[:0] = commands[i + 1:]
                    raise
            elif kind == "add":
                stream, held, kv_from = arg
                self._taken_ids.append(stream.request_id)
                if held:
                    group = _SampleGroup(stream.request_id, list(held))
                    self._groups.update(dict.fromkeys(
                        [stream.request_id, *(h.request_id for h in held)], group))
                self._add(stream, kv_from)
            else:
                self._end(arg, FinishReason.CANCELLED)
        if commands:
            self._observe_state()     # the gauges are fresh even when no step follows
        if closing and not (drain and controller.has_unfinished()):
            # No add can follow: add() checks _closing under the lock that took `commands`.
            for request_id in list(self._streams):
                self._end(request_id, FinishReason.CANCELLED)
            controller.pop_finished()
            self._observe_state()
            return False
        if controller.has_unfinished() and not self._step():
            with self._lock:
                if not (self._inbox or self._closing):
                    self._lock.wait(IDLE_WAIT_S)
        # Finished requests were handed out; a long-running controller must not keep them.
        controller.pop_finished()
        return self.down_reason is None

    def _add(self, stream: RequestStream, kv_from: tuple[str, int] | None = None) -> None:
        try:
            self.controller.add_request(stream.request,
                                        resume=bool(stream.request.output_token_ids),
                                        kv_from=kv_from)
        except Exception as e:
            # The controller refused what validation passed: report it on the stream.
            self._finish(stream, FinishReason.ERROR, error=f"{type(e).__name__}: {e}")
            return
        self._streams[stream.request_id] = stream

    def _step(self) -> bool:
        """Fills the engine's pipe, collects its oldest batch and delivers its tokens.
        False when nothing could be scheduled and nothing is in flight."""
        try:
            collected = self.runner.step()
        except BatchFailed as e:
            failed = _request_ids(e.batch)
            if self.on_down is None:
                logger.error("step failed; failing requests %s", failed, exc_info=e.cause)
                # A multi-host replica that lost a process: the requests end as
                # unavailable (gRPC UNAVAILABLE), which a client may retry elsewhere.
                self._fail(failed, f"step failed: {e}",
                           unavailable=isinstance(e.cause, ReplicaUnavailable))
            else:
                self._step_failures += 1
                logger.error("replica %d: step failed (%d in a row); re-running requests %s "
                             "elsewhere", self.replica, self._step_failures, failed,
                             exc_info=e.cause)
                if self._step_failures >= self.max_step_failures:
                    self._go_down(f"{self._step_failures} steps in a row failed, the last "
                                  f"with {e}")
                    return True
                self._hand_over(failed, f"replica {self.replica}: step failed: {e}")
            self._recover_kv_cache()
            return True
        except Exception as e:
            logger.exception("scheduling failed; failing every request in flight")
            self._fail(list(self._streams), f"scheduling failed: {type(e).__name__}: {e}")
            return True
        if collected is None:
            return False
        self._step_failures = 0
        result = collected.result
        self.metrics.observe_step(collected.batch.num_tokens, result.duration_s)
        if self.on_step is not None:
            try:
                self.on_step(collected)
            except Exception:
                logger.exception("the server's on_step hook failed; serving goes on")
        for request_id, scored in result.prompt_logprobs.items():
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.add_prompt_logprobs(scored)
        for update in collected.updates:
            request_id = update.request.request_id
            stream = self._streams.get(request_id)
            if stream is not None:
                if update.request is not stream.request:
                    # The controller went on with the request re-created (a switching
                    # coordinator recomputes a soft-preempted one under TP).
                    stream.resume(update.request, stream.replica)
                self._deliver(stream, update.new_token_ids, update.finished,
                              result.logprobs.get(request_id))
        self._observe_state()
        return True

    def _recover_kv_cache(self) -> None:
        """After a failed step: when it lost the device's KV cache (an error on the device
        poisons the donated cache), the engine rebuilds it and every other request holding
        pages is recomputed from its tokens, so nothing else is lost."""
        recover = getattr(self.engine, "recover_kv_cache", None)
        if recover is not None and recover():
            self.runner.abandon()
            preempted = self.controller.preempt_all()
            logger.warning("the KV cache was lost and rebuilt; %d requests are recomputed",
                           preempted)
        self._observe_state()

    def _deliver(self, stream: RequestStream, new_token_ids: tuple[int, ...],
                 finished: bool, logprobs: TokenLogprobs | None = None) -> None:
        request = stream.request
        group = self._groups.get(request.request_id)
        if group is not None and group.held and new_token_ids:
            self._release_held(group)          # sample 0's prompt is in the prefix cache
        try:
            stopped = stream.add_tokens(new_token_ids, logprobs)
        except Exception as e:
            logger.exception("detokenizing request %s failed", request.request_id)
            self._end(request.request_id, FinishReason.ERROR,
                      error=f"detokenization failed: {type(e).__name__}: {e}")
            return
        if stopped:
            if not finished:
                self.controller.finish(request.request_id, FinishReason.STOP)
            self._finish(stream, FinishReason.STOP)
        elif finished:
            self._finish(stream, request.finish_reason or FinishReason.STOP, error=request.error)
        else:
            stream.push()
            if (self.on_prefilled is not None
                    and (len(request.output_token_ids) == 1 or request.request_id in self.moving)
                    and self.on_prefilled(stream)):
                self._handed_off(request.request_id)

    def _handed_off(self, request_id: str) -> None:
        """Its decode goes on on another replica (on_prefilled took its stream): released
        here, its pages back to the pool or the prefix cache, its stream left open."""
        self._streams.pop(request_id, None)
        self.controller.finish(request_id, FinishReason.STOP)
        with self._lock:
            self._in_flight.discard(request_id)

    def _release_held(self, group: _SampleGroup) -> None:
        for stream in group.take_held():
            self._groups.pop(stream.request_id, None)
            self._add(stream)

    def _hand_over(self, request_ids: Sequence[str], reason: str) -> None:
        """Releases the requests here (their pages freed) and hands their streams, with
        their held samples, to `on_down` to be re-run elsewhere."""
        streams = []
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                continue
            group = self._groups.pop(request_id, None)
            if group is not None and group.leader == request_id:
                for held in group.take_held():
                    self._groups.pop(held.request_id, None)
                    streams.append(held)
            try:
                self.controller.finish(request_id, FinishReason.ERROR)
            except Exception:
                logger.exception("controller failed to release request %s", request_id)
            streams.append(stream)
        self._give_away(streams, reason)
        self._observe_state()

    def _give_away(self, streams: list[RequestStream], reason: str) -> None:
        # Added there before they leave here, so a cancel in between reaches one of them.
        if streams:
            self.on_down(self, streams, reason)
        with self._lock:
            self._in_flight.difference_update(s.request_id for s in streams)

    def _go_down(self, reason: str) -> None:
        """Stops taking requests and hands every one it holds to `on_down` (on the loop
        thread, or the dying one: nothing else touches the controller)."""
        logger.error("replica %d is down: %s", self.replica, reason)
        with self._lock:
            self.down_reason = reason
            commands, self._inbox = self._inbox, []
        cancelled = {arg for kind, arg in commands if kind == "cancel"}
        streams = [s for kind, arg in commands if kind == "add" for s in (arg[0], *arg[1])]
        for group in {id(g): g for g in self._groups.values()}.values():
            streams.extend(group.take_held())
        self._groups.clear()
        for request_id, stream in list(self._streams.items()):
            try:
                self.controller.finish(request_id, FinishReason.ERROR)
            except Exception:
                logger.exception("controller failed to release request %s", request_id)
            streams.append(stream)
        self._streams.clear()
        moving = []
        for stream in streams:
            if stream.request_id in cancelled:
                self._finish(stream, FinishReason.CANCELLED)
            else:
                moving.append(stream)
        try:
            self.controller.pop_finished()
            self._observe_state()
        except Exception:
            logger.exception("replica %d: reading its state after going down failed",
                             self.replica)
        self._give_away(moving, f"replica {self.replica} is down: {reason}")

    def _fail(self, request_ids: Sequence[str], error: str, *, unavailable: bool = False
              ) -> None:
        for request_id in request_ids:
            self._end(request_id, FinishReason.ERROR, error=error, unavailable=unavailable)
        self._observe_state()

    def _end(self, request_id: str, reason: FinishReason, error: str | None = None, *,
             unavailable: bool = False) -> None:
        """Finishes a request in the controller (its pages freed) and for its caller."""
        group = self._groups.get(request_id)
        held = next((s for s in group.held if s.request_id == request_id), None) \
            if group is not None else None
        if held is not None:          # never reached the controller: nothing to free
            group.held.remove(held)
            self._finish(held, reason, error=error, unavailable=unavailable)
            return
        stream = self._streams.get(request_id)
        if stream is None:
            return                    # finished while the command was in the inbox
        try:
            self.controller.finish(request_id, reason)
        except Exception:
            logger.exception("controller failed to release request %s", request_id)
        self._finish(stream, reason, error=error, unavailable=unavailable)

    def _finish(self, stream: RequestStream, reason: FinishReason,
                error: str | None = None, *, unavailable: bool = False) -> None:
        """unavailable: the error is the replica's failure (StreamDelta.unavailable)."""
        request_id = stream.request_id
        self._streams.pop(request_id, None)
        with self._lock:
            self._in_flight.discard(request_id)
        metrics = stream.finish(reason, error, unavailable=unavailable)
        self.metrics.observe_finished(metrics, FinishReason(reason).value)
        group = self._groups.pop(request_id, None)
        if group is not None and group.leader == request_id and group.held:
            # Sample 0 ended before its first token: its samples end the same way.
            for other in group.take_held():
                self._finish(other, reason, error=error, unavailable=unavailable)

    def _observe_state(self) -> None:
        allocator = self.engine.allocator
        controller = self.controller
        waiting, running = controller.num_waiting, controller.num_running
        self.metrics.observe_state(
            pages_in_use=allocator.num_pages - allocator.num_free_pages,
            pages_total=allocator.num_pages, waiting=waiting, running=running,
            preemptions_total=controller.num_preemptions, replica=self.replica)
        work = 0.0
        if self._decode_token_s is not None:
            # Predicted seconds of work queued here: prefills, then every decode token.
            taken = controller.queued_prefills()
            with self._lock:
                for request_id in self._taken_ids:
                    self._inbox_prefills.pop(request_id, None)
                self._taken_ids.clear()
                self._taken_prefills = taken
                self.queued_prefills = taken.plus(self._inbox_queued())
            self.num_decoding = waiting + running - len(taken)
            work = self.queued_prefills.work_s + \
                controller.decode_tokens_left * self._decode_token_s
        self.load = (waiting, running, work)
        self.free_pages = allocator.num_free_pages
        if self.publishes_decode_contexts:
            self._decoders = controller.decoding_requests()


    @property
    def decode_contexts(self) -> tuple[int, ...]:
        """The context length of each request that decodes here (of those published after
        the last iteration: with `publishes_decode_contexts`), read now: the loop publishes
        the requests, not their lengths, which only a reader needs (a pass over every
        request on every step cost 3 ms at 10,000 queued)."""
        return tuple(r.num_tokens for r in self._decoders)

    def _inbox_queued(self) -> tuple[QueuedPrefill, ...]:
        """The inbox's requests as queued prefills now (under _lock), with the seconds
        add() gave and their whole prompt's (LARS's w_total)."""
        now = self.controller.clock.now()
        prefill_time = self.controller.prefill_time_cache.prefill_time
        return tuple([QueuedPrefill(x, deadline - now - x, max(x, prefill_time(n)), n)
                      for x, deadline, n in self._inbox_prefills.values()])


def _request_ids(batch: Batch) -> list[str]:
    return [c.request.request_id for c in batch.chunks]


@dataclasses.dataclass
class _SampleGroup:
    """The n samples of one prompt, in the loop: sample 0 (`leader`) runs first, the others
    wait in `held` until it has its first token."""

    leader: str
    held: list[RequestStream]

    def take_held(self) -> list[RequestStream]:
        """The waiting samples, which the group no longer holds."""
        held, self.held = self.held, []
        return held


class _OneAtATime:
    """A plain Executor as a PipelinedExecutor with one batch in flight."""

    max_in_flight = 1

    def __init__(self, executor):
        self.executor = executor

    def dispatch(self, batch: Batch) -> Batch:
        return batch

    def collect(self, batch: Batch) -> StepResult:
        return self.executor.execute(batch)
