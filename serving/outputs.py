"""What a caller gets back: outputs, stream deltas, request handles, and the text they carry.

The server's loop thread produces; callers on other threads (or an asyncio loop) consume.
A RequestHandle is the meeting point: the loop thread pushes StreamDeltas into it, and the
caller iterates them, waits for the final RequestOutput, or cancels. Concatenating a
request's deltas (token ids, text, logprobs) always gives its final output; with n > 1
samples each delta names its sample (`index`), and the request is done when all n are. A
RequestStream is the loop thread's side of one sample: it turns new tokens into deltas and
finishes it.

Text is produced incrementally by `IncrementalDetokenizer`, which also finds stop strings:
a byte-level tokenizer may split one UTF-8 character over several tokens, and a stop string
may span tokens, so neither can be decided from the newest token alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
from typing import AsyncIterator, Callable, Iterator, Protocol, Sequence

from medha_jax.request import FinishReason, Request, TokenLogprobs


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """Per-request timings in seconds on the server's monotonic clock.

    ttft = first_token_time - arrival_time; tpot = (finish - first_token) / max(n_out - 1, 1);
    queue_time = first time scheduled - arrival. Times are None (and derived values 0.0)
    when the request never got that far (cancelled or failed early). num_cached_tokens:
    prompt tokens taken from the prefix cache instead of computed, in the request's last
    admission (OpenAI's usage.prompt_tokens_details.cached_tokens).
    """

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    ttft: float
    tpot: float
    queue_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int
    num_cached_tokens: int = 0
    replica: int = 0                  # the replica that served it (Server(replicas=N))

    @classmethod
    def from_request(cls, req: Request, replica: int = 0) -> "RequestMetrics":
        n_out = len(req.output_token_ids)
        ttft = tpot = queue_time = 0.0
        if req.first_token_time is not None:
            ttft = req.first_token_time - req.arrival_time
            if req.finish_time is not None:
                tpot = (req.finish_time - req.first_token_time) / max(n_out - 1, 1)
        if req.first_scheduled_time is not None:
            queue_time = req.first_scheduled_time - req.arrival_time
        return cls(arrival_time=req.arrival_time, first_token_time=req.first_token_time,
                   finish_time=req.finish_time, ttft=ttft, tpot=tpot, queue_time=queue_time,
                   num_prompt_tokens=req.prompt_len, num_output_tokens=n_out,
                   num_preemptions=req.num_preemptions,
                   num_cached_tokens=req.num_cached_tokens, replica=replica)


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """One sample of a request (vLLM's CompletionOutput). logprobs: one entry per token of
    token_ids when SamplingParams.logprobs asked for them, else None; metrics: this
    sample's own (each sample is a request of its own in the scheduler)."""

    index: int
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    logprobs: tuple[TokenLogprobs, ...] | None = None
    error: str | None = None
    metrics: RequestMetrics | None = None
    unavailable: bool = False        # the error: no healthy replica could serve it


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """The whole result of one request. `error` says why when finish_reason == "error".

    The top-level token_ids, text, finish_reason, logprobs, metrics and error are sample
    0's; `outputs` holds all n samples (one when n == 1). prompt_logprobs: when asked, one
    entry per prompt token, the first None (nothing precedes it), as vLLM's."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    metrics: RequestMetrics
    error: str | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    outputs: tuple[CompletionOutput, ...] = ()


@dataclasses.dataclass(frozen=True)
class StreamDelta:
    """What one sample produced since its previous delta; its last one has finished=True.

    index: which sample (0..n-1). logprobs: one entry per token of token_ids when asked,
    else None. prompt_logprobs: on sample 0's first delta, when asked (see RequestOutput)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None
    index: int = 0
    logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    # With finish_reason "error": the replica serving it failed and no healthy one could
    # take it over (gRPC UNAVAILABLE, HTTP 503: the client may retry), not a bad request.
    unavailable: bool = False


class Tokenizer(Protocol):
    """medha_jax.checkpoint.Tokenizer: a Hugging Face `tokenizers.Tokenizer` as `backend`."""

    backend: object

    def decode(self, ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas and finds stop strings.

    Text comes from the tokenizers library's `DecodeStream` over the model's Hugging Face
    tokenizer (every medha_jax Tokenizer wraps one as `backend`, the GGUF-built ones too, so
    this is the only path): it decodes a short window of recent tokens with and without the
    newest and emits the difference (as Hugging Face's TextStreamer and TGI do: decoding
    only the new token would lose the leading space some tokenizers attach to a word, and
    decoding the whole output every step costs O(n) per token), and gives nothing while the
    newest tokens end inside a UTF-8 character.

    While generating, text that could be the start of a stop string is held back, so the
    deltas never contain text that is trimmed later.
    """

    def __init__(self, tokenizer: Tokenizer | None, stop: Sequence[str] = ()):
        if stop and tokenizer is None:
            raise ValueError(f"stop={tuple(stop)!r} needs a model with a tokenizer")
        self._tokenizer = tokenizer
        self._stream = None
        if tokenizer is not None:
            from tokenizers import Tokenizer as HfTokenizer
            from tokenizers.decoders import DecodeStream

            if not isinstance(getattr(tokenizer, "backend", None), HfTokenizer):
                raise TypeError(f"the tokenizer must wrap a tokenizers.Tokenizer as `backend` "
                                f"(medha_jax.checkpoint.Tokenizer does), got "
                                f"{type(tokenizer).__name__}")
            self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._num_decoded = 0        # ids whose text is in self.text
        self.text = ""               # all text decoded so far (trimmed at a stop string)
        self._emitted = 0            # characters of self.text already handed out
        self.stopped = False         # a stop string was found; self.text ends before it

    def add(self, token_ids: Sequence[int]) -> None:
        """Appends generated tokens; sets `stopped` when the text now contains a stop string."""
        self._ids.extend(token_ids)
        if self._stream is None or self.stopped or not token_ids:
            return
        new_text = self._stream.step(self._tokenizer.backend, [int(t) for t in token_ids])
        if new_text is None:
            return                   # nothing printable yet (e.g. half a UTF-8 character)
        searched_from = max(len(self.text) - max((len(s) for s in self._stop), default=0), 0)
        self._append(new_text)
        hits = [i for i in (self.text.find(s, searched_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def take_delta(self, final: bool) -> str:
        """Text not handed out yet; unless final, minus a tail that may begin a stop string.

        The final delta also flushes tokens still waiting to complete a UTF-8 character
        (the output ended inside one), so no generated byte is silently dropped.
        """
        if final and self._stream is not None and not self.stopped:
            self._flush()
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._held_back_chars()
        delta = self.text[self._emitted:max(end, self._emitted)]
        self._emitted += len(delta)
        return delta

    def _flush(self) -> None:
        """Appends the text of tokens DecodeStream still holds (it has no flush of its own):
        once, at the end, from a decode of the whole output."""
        if self._num_decoded == len(self._ids):
            return
        whole = self._tokenizer.decode(self._ids)
        rest = (whole[len(self.text):] if whole.startswith(self.text)
                else self._tokenizer.decode(self._ids[self._num_decoded:]))
        self._append(rest)

    def _append(self, new_text: str) -> None:
        self.text += new_text
        self._num_decoded = len(self._ids)

    def _held_back_chars(self) -> int:
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest


@dataclasses.dataclass
class _Sample:
    """What a handle has gathered of one sample from its deltas."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    last: StreamDelta | None = None          # its final delta, once finished

    def output(self, index: int) -> CompletionOutput:
        last = self.last
        return CompletionOutput(
            index=index, token_ids=tuple(self.token_ids), text="".join(self.text),
            finish_reason=last.finish_reason,
            logprobs=None if self.logprobs is None else tuple(self.logprobs),
            error=last.error, metrics=last.metrics, unavailable=last.unavailable)


class RequestHandle:
    """A submitted request: iterate it for StreamDeltas, or wait for `result()`, or `cancel()`.

    With n samples the deltas of all n interleave (each names its `index`); iteration and
    `result()` end when every sample has finished, and `cancel()` cancels them all.
    Deltas go to a thread-safe queue, or to an asyncio queue when the handle was created for
    an event loop (`Server.generate_async`); the loop thread never blocks on a slow reader.
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 cancel: Callable[[str], bool], loop: asyncio.AbstractEventLoop | None = None,
                 *, id: str | None = None, ids: Sequence[str] | None = None):
        """request_id: the caller's label, echoed in every delta and the output (not
        necessarily unique); ids: the server's identities of the request's n samples
        (unique), what `cancel` names; id: sample 0's (default: request_id)."""
        self.request_id = request_id
        self.id = request_id if id is None else id
        self.ids = (self.id,) if ids is None else tuple(ids)
        if self.ids[0] != self.id:
            raise ValueError(f"ids {self.ids} must start with sample 0's id {self.id!r}")
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.n = len(self.ids)
        self._cancel = cancel
        self._loop = loop
        self._deltas: queue.SimpleQueue[StreamDelta] = queue.SimpleQueue()
        self._async_deltas: asyncio.Queue[StreamDelta] | None = (
            asyncio.Queue() if loop is not None else None)
        self._done = threading.Event()
        self._output: RequestOutput | None = None
        self._samples = [_Sample() for _ in range(self.n)]
        self._num_finished = 0
        self._prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None

    # ---- producer side (the server's loop thread) ----

    def _push(self, delta: StreamDelta) -> None:
        sample = self._samples[delta.index]
        sample.token_ids.extend(delta.token_ids)
        sample.text.append(delta.text)
        if delta.logprobs is not None:
            sample.logprobs = (sample.logprobs or []) + list(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self._prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            sample.last = delta
            self._num_finished += 1
            if self._num_finished == self.n:
                self._output = self._final_output()
        if self._async_deltas is not None:
            try:
                self._loop.call_soon_threadsafe(self._async_deltas.put_nowait, delta)
            except RuntimeError:
                pass                 # the caller's event loop is closed: nobody is listening
        else:
            self._deltas.put(delta)
        if self._output is not None:
            self._done.set()

    def _push_item(self, item) -> None:
        """An item that is not a delta, for the asyncio consumer, in order with the deltas
        (a replica actor's prefill stream: serving.ray_handoff); `item.finished` ends the
        iteration as a final delta does, without finishing the handle."""
        try:
            self._loop.call_soon_threadsafe(self._async_deltas.put_nowait, item)
        except RuntimeError:
            pass                     # the caller's event loop is closed: nobody is listening

    def _final_output(self) -> RequestOutput:
        outputs = tuple(sample.output(i) for i, sample in enumerate(self._samples))
        first = outputs[0]
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
            token_ids=first.token_ids, text=first.text, finish_reason=first.finish_reason,
            metrics=first.metrics, error=first.error, logprobs=first.logprobs,
            prompt_logprobs=self._prompt_logprobs, outputs=outputs)

    # ---- consumer side (any thread) ----

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> bool:
        """Asks the server to stop this request (all its samples); each final delta says
        "cancelled". False when none was in flight."""
        return any([self._cancel(i) for i in self.ids])     # a list: cancel every one

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Blocks until the request finishes; raises TimeoutError after `timeout` seconds."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout=} s")
        return self._output

    def __iter__(self) -> Iterator[StreamDelta]:
        if self._async_deltas is not None:
            raise TypeError(f"request {self.request_id} streams to an event loop; use `async for`")
        left = self.n
        while left:
            delta = self._deltas.get()
            yield delta
            left -= delta.finished

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        if self._async_deltas is None:
            raise TypeError(f"request {self.request_id} was not submitted for asyncio")
        left = self.n
        while left:
            delta = await self._async_deltas.get()
            yield delta
            left -= delta.finished


class RequestStream:
    """The loop thread's side of one in-flight sample: tokens in, deltas out to its handle.

    Tokens (and their logprobs) given to `add_tokens` go out with the next `push` or
    `finish`; prompt logprobs gathered from the steps go out with the first delta after
    they are complete (the first token: the whole prompt has been computed by then).

    When its replica fails, the stream moves to another (`resume`): the same handle,
    detokenizer and delta state go on, so the caller sees one uninterrupted stream."""

    def __init__(self, request: Request, handle: RequestHandle,
                 detokenizer: IncrementalDetokenizer, *, index: int = 0, replica: int = 0):
        self.request, self.handle, self.detokenizer = request, handle, detokenizer
        self.index = index
        self.replica = replica
        self.generated: list[int] = []      # every token handed to add_tokens
        self.failovers = 0                  # times it moved off a failed replica
        sampling = request.sampling
        self._wants_logprobs = sampling.logprobs is not None
        self._new_token_ids: list[int] = []
        self._new_logprobs: list[TokenLogprobs] = []
        # Position p of the prompt -> its logprobs; position 0 has none. Recomputed
        # positions (after a preemption) overwrite.
        self._prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] * request.prompt_len if sampling.prompt_logprobs is not None else None)

    @property
    def request_id(self) -> str:
        """The server's identity of the request (the loop's key); deltas carry the label."""
        return self.request.request_id

    def add_prompt_logprobs(self, scored: dict[int, TokenLogprobs]) -> None:
        """Records the prompt positions a step computed (StepResult.prompt_logprobs)."""
        if self._prompt_logprobs is not None:
            for position, logprobs in scored.items():
                self._prompt_logprobs[position] = logprobs

    def add_tokens(self, new_token_ids: Sequence[int],
                   logprobs: TokenLogprobs | None = None) -> bool:
        """Detokenizes new tokens (to go out with the next delta); True when the text now
        ends at a stop string (the request is done: the caller finishes it)."""
        self._new_token_ids.extend(new_token_ids)
        self.generated.extend(new_token_ids)
        if self._wants_logprobs and logprobs is not None:
            self._new_logprobs.append(logprobs)
        self.detokenizer.add(new_token_ids)
        return self.detokenizer.stopped

    def push(self) -> None:
        """Hands the new tokens and the text that is safe to show so far to the caller."""
        text = self.detokenizer.take_delta(final=False)
        if self._new_token_ids or text:
            self.handle._push(self._delta(text, finished=False))

    def resume(self, request: Request, replica: int) -> None:
        """Goes on as `request` (its re-run, see serving.replicas.resumed_request) on
        `replica`; tokens not yet pushed go out with its next delta."""
        if request.request_id != self.request_id:
            raise ValueError(f"resuming {self.request_id!r} as {request.request_id!r}")
        self.request, self.replica = request, replica

    def finish(self, reason: FinishReason, error: str | None = None, *,
               unavailable: bool = False) -> RequestMetrics:
        """Pushes the final delta (the rest of the text and tokens) and returns the
        request's metrics. unavailable: the error is its replica's failure (StreamDelta)."""
        metrics = RequestMetrics.from_request(self.request, self.replica)
        self.handle._push(self._delta(
            self.detokenizer.take_delta(final=True), finished=True,
            finish_reason=FinishReason(reason).value, metrics=metrics, error=error,
            unavailable=unavailable))
        return metrics

    def _delta(self, text: str, **final) -> StreamDelta:
        prompt_logprobs = None
        if self._prompt_logprobs is not None and (self._new_token_ids or final["finished"]):
            prompt_logprobs, self._prompt_logprobs = tuple(self._prompt_logprobs), None
        delta = StreamDelta(
            self.handle.request_id, tuple(self._new_token_ids), text, index=self.index,
            logprobs=tuple(self._new_logprobs) if self._wants_logprobs else None,
            prompt_logprobs=prompt_logprobs, **final)
        self._new_token_ids, self._new_logprobs = [], []
        return delta
