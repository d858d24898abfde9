"""What a caller gets back: outputs, stream deltas, request handles, and the text they carry.

The server's loop thread produces; callers on other threads (or an asyncio loop) consume.
A RequestHandle is the meeting point: the loop thread pushes StreamDeltas into it, and the
caller iterates them, waits for the final RequestOutput, or cancels. Concatenating a
request's deltas (token ids and text) always gives its final output. A RequestStream is
the loop thread's side of one request: it turns new tokens into deltas and finishes it.

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

from medha_jax.request import FinishReason, Request


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """Per-request timings in seconds on the server's monotonic clock.

    ttft = first_token_time - arrival_time; tpot = (finish - first_token) / max(n_out - 1, 1);
    queue_time = first time scheduled - arrival. Times are None (and derived values 0.0)
    when the request never got that far (cancelled or failed early).
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

    @classmethod
    def from_request(cls, req: Request) -> "RequestMetrics":
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
                   num_preemptions=req.num_preemptions)


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """The whole result of one request. `error` says why when finish_reason == "error"."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    metrics: RequestMetrics
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class StreamDelta:
    """What one request produced since its previous delta; the last one has finished=True."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None


class Tokenizer(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas and finds stop strings.

    Decodes a short window of recent tokens twice (with and without the newest ones) and
    emits the difference, as Hugging Face's TextStreamer and TGI do: decoding only the new
    token would lose the leading space some tokenizers attach to a word, and decoding the
    whole output every step costs O(n) per token. A window ending in U+FFFD is an
    incomplete UTF-8 character; it waits for the next token.

    While generating, text that could be the start of a stop string is held back, so the
    deltas never contain text that is trimmed later.
    """

    def __init__(self, tokenizer: Tokenizer | None, stop: Sequence[str] = ()):
        if stop and tokenizer is None:
            raise ValueError(f"stop={tuple(stop)!r} needs a model with a tokenizer")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._prefix_offset = 0      # window start: ids before it are fully in self.text
        self._read_offset = 0        # ids before it have been turned into text
        self.text = ""               # all text decoded so far (trimmed at a stop string)
        self._emitted = 0            # characters of self.text already handed out
        self.stopped = False         # a stop string was found; self.text ends before it

    def add(self, token_ids: Sequence[int]) -> None:
        """Appends generated tokens; sets `stopped` when the text now contains a stop string."""
        self._ids.extend(token_ids)
        if self._tokenizer is None or self.stopped:
            return
        new_text = self._pending_text()
        if not new_text or new_text.endswith("\ufffd"):
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
        if final and self._tokenizer is not None and not self.stopped:
            self._append(self._pending_text())
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._held_back_chars()
        delta = self.text[self._emitted:max(end, self._emitted)]
        self._emitted += len(delta)
        return delta

    def _pending_text(self) -> str:
        """Text of the tokens not yet turned into text, decoded after the window's start."""
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        window = self._tokenizer.decode(self._ids[self._prefix_offset:])
        return window[len(prefix):]

    def _append(self, new_text: str) -> None:
        self.text += new_text
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def _held_back_chars(self) -> int:
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest


class RequestHandle:
    """A submitted request: iterate it for StreamDeltas, or wait for `result()`, or `cancel()`.

    Deltas go to a thread-safe queue, or to an asyncio queue when the handle was created for
    an event loop (`Server.generate_async`); the loop thread never blocks on a slow reader.
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 cancel: Callable[[str], bool], loop: asyncio.AbstractEventLoop | None = None,
                 *, id: str | None = None):
        """request_id: the caller's label, echoed in every delta and the output (not
        necessarily unique); id: the server's identity of the request (unique), what
        `cancel` names (default: request_id)."""
        self.request_id = request_id
        self.id = request_id if id is None else id
        self.prompt_token_ids = tuple(prompt_token_ids)
        self._cancel = cancel
        self._loop = loop
        self._deltas: queue.SimpleQueue[StreamDelta] = queue.SimpleQueue()
        self._async_deltas: asyncio.Queue[StreamDelta] | None = (
            asyncio.Queue() if loop is not None else None)
        self._done = threading.Event()
        self._output: RequestOutput | None = None
        self._token_ids: list[int] = []
        self._text: list[str] = []

    # ---- producer side (the server's loop thread) ----

    def _push(self, delta: StreamDelta) -> None:
        self._token_ids.extend(delta.token_ids)
        self._text.append(delta.text)
        if delta.finished:
            self._output = RequestOutput(
                request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
                token_ids=tuple(self._token_ids), text="".join(self._text),
                finish_reason=delta.finish_reason, metrics=delta.metrics, error=delta.error)
        if self._async_deltas is not None:
            try:
                self._loop.call_soon_threadsafe(self._async_deltas.put_nowait, delta)
            except RuntimeError:
                pass                 # the caller's event loop is closed: nobody is listening
        else:
            self._deltas.put(delta)
        if delta.finished:
            self._done.set()

    # ---- consumer side (any thread) ----

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> bool:
        """Asks the server to stop this request; its final delta says "cancelled"."""
        return self._cancel(self.id)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Blocks until the request finishes; raises TimeoutError after `timeout` seconds."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not finished after {timeout=} s")
        return self._output

    def __iter__(self) -> Iterator[StreamDelta]:
        if self._async_deltas is not None:
            raise TypeError(f"request {self.request_id} streams to an event loop; use `async for`")
        while True:
            delta = self._deltas.get()
            yield delta
            if delta.finished:
                return

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        if self._async_deltas is None:
            raise TypeError(f"request {self.request_id} was not submitted for asyncio")
        while True:
            delta = await self._async_deltas.get()
            yield delta
            if delta.finished:
                return


class RequestStream:
    """The loop thread's side of one in-flight request: tokens in, deltas out to its handle."""

    def __init__(self, request: Request, handle: RequestHandle,
                 detokenizer: IncrementalDetokenizer):
        self.request, self.handle, self.detokenizer = request, handle, detokenizer

    @property
    def request_id(self) -> str:
        """The server's identity of the request (the loop's key); deltas carry the label."""
        return self.request.request_id

    def add_tokens(self, new_token_ids: Sequence[int]) -> bool:
        """Detokenizes new tokens; True when the text now ends at a stop string (the
        request is done: the caller finishes it)."""
        self.detokenizer.add(new_token_ids)
        return self.detokenizer.stopped

    def push(self, new_token_ids: Sequence[int]) -> None:
        """Hands the tokens and the text that is safe to show so far to the caller."""
        text = self.detokenizer.take_delta(final=False)
        if new_token_ids or text:
            self.handle._push(StreamDelta(self.handle.request_id, tuple(new_token_ids), text,
                                          finished=False))

    def finish(self, reason: FinishReason, new_token_ids: Sequence[int] = (),
               error: str | None = None) -> RequestMetrics:
        """Pushes the final delta (the rest of the text) and returns the request's metrics."""
        metrics = RequestMetrics.from_request(self.request)
        self.handle._push(StreamDelta(
            self.handle.request_id, tuple(new_token_ids), self.detokenizer.take_delta(final=True),
            finished=True, finish_reason=FinishReason(reason).value, metrics=metrics,
            error=error))
        return metrics
