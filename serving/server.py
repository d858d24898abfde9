"""The Python serving API: a Server runs one replica's controller loop on its own thread.

    with Server("smollm2-135m") as server:
        out = server.generate("Hello", SamplingParams(temperature=0, max_tokens=16))
        for delta in server.generate_stream("Tell me a story"):
            print(delta.text, end="")

Threads. The controller (scheduler + engine) is single-threaded; only the loop thread
touches it. Callers on any thread (or an asyncio loop) validate and tokenize their prompt
on their own thread, then post "add" and "cancel" commands to an inbox that the loop thread
drains before every step. Results flow back through RequestHandles (serving/outputs.py).

What the loop adds on top of the controller: incremental detokenization and stop strings
(the controller handles stop token ids, end of sequence and max_tokens), per-request
metrics, Prometheus metrics, and containment of failures: an exception inside a step fails
the requests it touched with FinishReason.ERROR and the loop keeps serving the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import numbers
import threading
from typing import Any, AsyncIterator, Iterable, Iterator, Mapping, Sequence

from medha_jax.request import SLO, Batch, FinishReason, Request, StepResult, WallClock
from medha_jax.sampling_params import SamplingParams
from medha_jax.scheduler.controller import CapacityError
from serving.metrics import ServerMetrics
from serving.outputs import (IncrementalDetokenizer, RequestHandle, RequestMetrics,
                             RequestOutput, StreamDelta)

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]      # text, or token ids (a list, tuple or 1-D numpy array)


class _ObservedExecutor:
    """Wraps the engine to record step metrics and which batch is running.

    When a step raises, `running_batch` names the requests the failure touched.
    """

    def __init__(self, engine, metrics: ServerMetrics):
        self.engine = engine
        self.metrics = metrics
        self.running_batch: Batch | None = None

    def execute(self, batch: Batch) -> StepResult:
        self.running_batch = batch
        result = self.engine.execute(batch)
        self.running_batch = None
        self.metrics.observe_step(batch.num_tokens, result.duration_s)
        return result


@dataclasses.dataclass(eq=False)
class _Stream:
    """Loop-thread state of one in-flight request."""

    request: Request
    handle: RequestHandle
    detokenizer: IncrementalDetokenizer


class Server:
    """One model replica behind a thread-safe generate / stream / submit / cancel API."""

    def __init__(self, model="smollm2-135m", *, parallel=None, scheduler: str = "lars",
                 engine_config=None, default_slo: SLO | None = None, dtype: str | None = None,
                 metrics_port: int | None = None, warmup: bool = True, predictor=None,
                 scheduler_options: Mapping[str, Any] | None = None):
        """model: a preset name, a Hugging Face directory, a .gguf file, a loaded Model, or
        an Engine to reuse (already compiled; then parallel, dtype and engine_config must
        be None). One engine serves one Server at a time.

        predictor: a fitted RuntimePredictor to reuse; by default the engine times a
        calibration sweep and fits one (engine.fit_predictor()).
        scheduler_options: further keyword arguments of make_controller, e.g.
        {"target_batch_time_s": 0.5} on a CPU, where one step takes longer than the
        default target of 50 ms.
        """
        # Heavy imports here, so `import serving.server` (and medha_jax) stays cheap.
        from medha_jax.engine import Engine, EngineConfig
        from medha_jax.model import load_model
        from medha_jax.scheduler.factory import POLICY_NAMES, make_controller

        if scheduler not in POLICY_NAMES:
            raise ValueError(f"unknown scheduler {scheduler!r}; known: {', '.join(POLICY_NAMES)}")
        if default_slo is not None and not isinstance(default_slo, SLO):
            raise TypeError(f"default_slo must be an SLO, got {type(default_slo).__name__}")
        if isinstance(model, Engine):
            given = {k: v for k, v in [("parallel", parallel), ("dtype", dtype),
                                       ("engine_config", engine_config)] if v is not None}
            if given:
                raise ValueError(f"{', '.join(given)} must be None when model is an Engine "
                                 "(it was built with its own)")
            self.engine = model
        else:
            self.engine = Engine(load_model(model, parallel=parallel, dtype=dtype),
                                 engine_config or EngineConfig())
        self.model = self.engine.model
        self.config = self.model.config
        self.tokenizer = self.model.tokenizer
        self.policy = scheduler
        self.default_slo = default_slo or SLO()
        if warmup:
            self.engine.warmup()
        self.metrics = ServerMetrics()
        self._executor = _ObservedExecutor(self.engine, self.metrics)
        self._clock = WallClock()
        eos = tuple(self.tokenizer.eos_token_ids) if self.tokenizer is not None else ()
        self.controller = make_controller(
            scheduler, executor=self._executor, allocator=self.engine.allocator,
            clock=self._clock, predictor=predictor or self.engine.fit_predictor(),
            model_config=self.config, eos_token_ids=eos,
            max_model_len=self.engine.max_model_len,
            token_buckets=self.engine.ladder.token_buckets,
            max_seqs_per_batch=self.engine.max_seqs, default_slo=self.default_slo,
            **(scheduler_options or {}))

        self._lock = threading.Condition()          # guards everything below it
        self._inbox: list[tuple[str, object]] = []  # ("add", _Stream) | ("cancel", request_id)
        self._handles: dict[str, RequestHandle] = {}  # in flight, by id
        self._closing = False
        self._drain_on_close = False
        self._ids = itertools.count()
        self._streams: dict[str, _Stream] = {}      # loop thread only
        self._observe_state()
        self.metrics_port = (self.metrics.serve_http(metrics_port)
                             if metrics_port is not None else None)
        self._thread = threading.Thread(target=self._loop, name="medha-server-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_total_pages(self) -> int:
        return self.engine.allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.engine.allocator.num_free_pages

    @property
    def closed(self) -> bool:
        return self._closing

    def submit(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
               slo: SLO | None = None, priority: int = 0, request_id: str | None = None,
               _loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Queues one request and returns at once. Raises ValueError naming a bad field."""
        params = SamplingParams() if sampling_params is None else sampling_params
        try:
            prompt_ids = self._validate(prompt, params, slo, priority)
            detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
        except (ValueError, TypeError):
            self.metrics.requests_rejected.inc()
            raise
        with self._lock:
            if self._closing:
                raise RuntimeError("the server is closed")
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
            elif not isinstance(request_id, str) or not request_id:
                raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
            if request_id in self._handles:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            request = Request(request_id=request_id, prompt_len=len(prompt_ids),
                              max_new_tokens=params.max_tokens, arrival_time=self._clock.now(),
                              slo=slo or self.default_slo, priority=priority,
                              prompt_token_ids=prompt_ids, sampling=params)
            handle = RequestHandle(request_id, prompt_ids, self.cancel, loop=_loop)
            self._handles[request_id] = handle
            self._inbox.append(("add", _Stream(request, handle, detokenizer)))
            self._lock.notify()
        return handle

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 slo: SLO | None = None, priority: int = 0
                 ) -> RequestOutput | list[RequestOutput]:
        """Blocks until done. One prompt (a str or a list of token ids) -> one output;
        a list of prompts -> a list of outputs in order (all submitted before any waits,
        so they are batched). sampling_params: one for all, or one per prompt."""
        batch = list(prompts) if not isinstance(prompts, str) else [prompts]
        single = isinstance(prompts, str) or (batch and all(_is_token_id(t) for t in batch))
        batch = [prompts] if single else batch
        if not batch:
            raise ValueError("prompts is empty: pass a prompt (a str or token ids) "
                             "or a non-empty list of prompts")
        if isinstance(sampling_params, Sequence):
            if single or len(sampling_params) != len(batch):
                raise ValueError(f"got {len(sampling_params)} sampling_params for "
                                 f"{len(batch)} prompts; pass one, or one per prompt")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(batch)
        handles = []
        try:
            for prompt, p in zip(batch, params):
                handles.append(self.submit(prompt, p, slo=slo, priority=priority))
        except BaseException:
            for handle in handles:       # all or nothing: the caller gets no ids back
                handle.cancel()
            raise
        outputs = [handle.result() for handle in handles]
        return outputs[0] if single else outputs

    def generate_stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                        slo: SLO | None = None, priority: int = 0,
                        request_id: str | None = None) -> Iterator[StreamDelta]:
        """Submits now (bad input raises here) and returns an iterator of deltas.
        Closing the iterator early (break, garbage collection) cancels the request."""
        handle = self.submit(prompt, sampling_params, slo=slo, priority=priority,
                             request_id=request_id)
        return _cancel_when_abandoned(iter(handle), handle)

    def generate_async(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                       slo: SLO | None = None, priority: int = 0,
                       request_id: str | None = None) -> AsyncIterator[StreamDelta]:
        """The asyncio form of generate_stream; call it from a coroutine:
        `async for delta in server.generate_async(prompt): ...`"""
        handle = self.submit(prompt, sampling_params, slo=slo, priority=priority,
                             request_id=request_id, _loop=asyncio.get_running_loop())
        return _cancel_when_abandoned_async(handle)

    def cancel(self, request_id: str) -> bool:
        """Cancels an in-flight request (its final delta says "cancelled"); False if unknown."""
        with self._lock:
            if request_id not in self._handles:
                return False
            self._inbox.append(("cancel", request_id))
            self._lock.notify()
        return True

    def metrics_text(self) -> str:
        return self.metrics.text()

    def close(self, *, drain: bool = False, timeout: float | None = None) -> None:
        """Stops the server: cancels in-flight requests (or, with drain=True, lets them
        finish), joins the loop thread and frees every KV page. Idempotent."""
        with self._lock:
            self._closing = True
            self._drain_on_close = drain
            self._lock.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the server loop did not stop within {timeout=} s")
        self.metrics.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ validation (caller thread)

    def _validate(self, prompt: Prompt, params, slo, priority) -> list[int]:
        """The prompt's token ids, once every argument is known to be servable."""
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if slo is not None and not isinstance(slo, SLO):
            raise TypeError(f"slo must be an SLO, got {type(slo).__name__}")
        if not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {priority!r}")
        prompt_ids = self._prompt_token_ids(prompt)
        self.controller.check_fits(len(prompt_ids), params.max_tokens)
        return prompt_ids

    def _prompt_token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt: model {self.config.name!r} has no tokenizer; "
                                 "pass token ids instead of text")
            ids = list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, Iterable) and not isinstance(prompt, (bytes, bytearray)):
            ids = []
            for i, t in enumerate(prompt):
                if not _is_token_id(t):
                    raise ValueError(f"prompt[{i}] must be an int token id, got {t!r}")
                if not 0 <= t < self.config.vocab_size:
                    raise ValueError(f"prompt[{i}] = {t} is outside the vocabulary "
                                     f"[0, {self.config.vocab_size})")
                ids.append(int(t))
        else:
            raise TypeError(f"prompt must be a str or a list of token ids, "
                            f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt is empty: it needs at least one token")
        return ids

    # ------------------------------------------------------------------ the loop thread

    def _loop(self) -> None:
        while True:
            try:
                if not self._iterate():
                    return
            except Exception as e:
                # A bug outside the step itself: fail the requests in flight rather than
                # leave their callers waiting on a dead thread, and keep serving.
                logger.exception("server loop iteration failed")
                for request_id in list(self._streams):
                    self._cancel(request_id, FinishReason.ERROR,
                                 error=f"server loop failed: {type(e).__name__}: {e}")

    def _iterate(self) -> bool:
        """Drains the inbox, then runs one step. False once the server has closed."""
        with self._lock:
            while not (self._inbox or self._closing or self.controller.has_unfinished()):
                self._lock.wait()
            commands, self._inbox = self._inbox, []
            closing, drain = self._closing, self._drain_on_close
        for kind, arg in commands:
            if kind == "add":
                self._add(arg)
            else:
                self._cancel(arg, FinishReason.CANCELLED)
        if closing and not (drain and self.controller.has_unfinished()):
            # No add can follow: submit checks _closing under the lock that took `commands`.
            for request_id in list(self._streams):
                self._cancel(request_id, FinishReason.CANCELLED)
            self.controller.pop_finished()
            self._observe_state()
            return False
        if self.controller.has_unfinished():
            steps_before = self.controller.num_steps
            self._step()
            if self.controller.num_steps == steps_before:
                # Nothing could run (e.g. pages are short): wait briefly for news, not spin.
                with self._lock:
                    if not (self._inbox or self._closing):
                        self._lock.wait(0.002)
        # Finished requests were handed out; a long-running controller must not keep them.
        self.controller.pop_finished()
        return True

    def _add(self, stream: _Stream) -> None:
        request = stream.request
        try:
            self.controller.add_request(request)
        except Exception as e:
            # The controller refused what check_fits passed: report it on the stream.
            self._finish(stream, FinishReason.ERROR, error=f"{type(e).__name__}: {e}")
            return
        self._streams[request.request_id] = stream

    def _cancel(self, request_id: str, reason: FinishReason, error: str | None = None) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return                    # finished while the cancel was in the inbox
        try:
            if reason is FinishReason.CANCELLED:
                self.controller.cancel(request_id)
            else:
                self.controller.finish(request_id, reason)
        except Exception:
            logger.exception("controller failed to release request %s", request_id)
        self._finish(stream, reason, error=error)

    def _step(self) -> None:
        try:
            updates = self.controller.step()
        except Exception as e:
            batch = self._executor.running_batch
            self._executor.running_batch = None
            # A failure inside the engine touched the batch's requests; one in the scheduler
            # may have left any request half-updated, so fail them all.
            failed = ([c.request.request_id for c in batch.chunks] if batch is not None
                      else list(self._streams))
            logger.exception("step failed; failing requests %s", failed)
            message = f"step failed: {type(e).__name__}: {e}"
            for request_id in failed:
                self._cancel(request_id, FinishReason.ERROR, error=message)
            self._observe_state()
            return
        for update in updates:
            stream = self._streams.get(update.request.request_id)
            if stream is not None:
                self._deliver(stream, update.new_token_ids, update.finished)
        self._observe_state()

    def _deliver(self, stream: _Stream, new_token_ids: tuple[int, ...], finished: bool) -> None:
        request = stream.request
        try:
            stream.detokenizer.add(new_token_ids)
        except Exception as e:
            logger.exception("detokenizing request %s failed", request.request_id)
            self._cancel(request.request_id, FinishReason.ERROR,
                         error=f"detokenization failed: {type(e).__name__}: {e}")
            return
        if stream.detokenizer.stopped and not finished:
            self.controller.finish(request.request_id, FinishReason.STOP)
        if stream.detokenizer.stopped:
            self._finish(stream, FinishReason.STOP, new_token_ids)
        elif finished:
            self._finish(stream, request.finish_reason or FinishReason.STOP, new_token_ids,
                         error=request.error)
        else:
            text = stream.detokenizer.take_delta(final=False)
            if new_token_ids or text:
                stream.handle._push(StreamDelta(request.request_id, tuple(new_token_ids), text,
                                                finished=False))

    def _finish(self, stream: _Stream, reason: FinishReason, new_token_ids=(),
                error: str | None = None) -> None:
        request = stream.request
        self._streams.pop(request.request_id, None)
        with self._lock:
            self._handles.pop(request.request_id, None)
        metrics = RequestMetrics.from_request(request)
        self.metrics.observe_finished(metrics, reason.value)
        stream.handle._push(StreamDelta(
            request.request_id, tuple(new_token_ids), stream.detokenizer.take_delta(final=True),
            finished=True, finish_reason=reason.value, metrics=metrics, error=error))

    def _observe_state(self) -> None:
        allocator = self.engine.allocator
        self.metrics.observe_state(
            pages_in_use=allocator.num_pages - allocator.num_free_pages,
            pages_total=allocator.num_pages, waiting=self.controller.num_waiting,
            running=self.controller.num_running,
            preemptions_total=self.controller.num_preemptions)


def _is_token_id(value) -> bool:
    # numbers.Integral admits numpy integers; bool is an int but never a token.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _cancel_when_abandoned(deltas: Iterator[StreamDelta], handle: RequestHandle
                           ) -> Iterator[StreamDelta]:
    try:
        yield from deltas
    finally:
        if not handle.finished:
            handle.cancel()


async def _cancel_when_abandoned_async(handle: RequestHandle) -> AsyncIterator[StreamDelta]:
    try:
        async for delta in handle:
            yield delta
    finally:
        if not handle.finished:
            handle.cancel()
