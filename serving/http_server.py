"""The OpenAI-compatible HTTP API over a Server, on Starlette + uvicorn.

    with Server("smollm2-135m") as server, HttpServer(server, port=8000) as http:
        ...   # openai.OpenAI(base_url=f"{http.url}/v1", api_key="unused")

Routes: POST /v1/completions, POST /v1/chat/completions (both stream as server-sent events,
`data: {...}` chunks then `data: [DONE]`), GET /v1/models, GET /health, GET /metrics.
Both take `n` (n choices, sampled from one prefill; streamed chunks name their choice's
index) and logprobs (completions: `logprobs: k`, with `echo: true` the prompt's too; chat:
`logprobs: true` and `top_logprobs: k`), k <= 20 (serving.openai_logprobs).

Beyond OpenAI's fields, `priority` (an int, lower = more important, default 0; vLLM's
extension): a client may ask for a class more important than the default only with a
priority token (serving.auth). SLOs are the server's default.

Errors are OpenAI error objects, `{"error": {"message", "type", "param", "code"}}`:
400 a bad field, malformed JSON, JSON nested deeper than MAX_JSON_DEPTH or a priority
outside the server's RequestLimits, 401 a missing or wrong bearer token (/metrics needs it
too; /health does not), 403 a priority above the default without a priority token,
404 an unknown model, 408 a body not received within `body_timeout_s`, 413 a body or a
prompt + max_tokens too long for the server, 429 more requests open than
`max_concurrent_requests`, 503 the server is closing or more than `max_connections`
connections are open. Parsing, tokenization, chat rendering and validation run on a worker
thread, never on the event loop, so a large or slow request does not stall the streams of
others; a bad request never reaches the loop thread. A client has `header_timeout_s` to
send each request's headers (uvicorn itself has no such deadline: a half-open connection
would hold a connection slot forever).

A client that goes away (closes the stream or the connection) cancels its request, which
frees its KV pages; the same path as gRPC's call callbacks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
from typing import Any, AsyncIterator, Callable

import h11
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from medha_jax.sampling_params import MAX_LOGPROBS, SamplingParams
from medha_jax.scheduler.controller import CapacityError
from serving import validation
from serving.auth import Access
from serving.openai_logprobs import TokenText, chat_logprobs, completion_logprobs
from serving.outputs import RequestHandle, StreamDelta

MAX_BODY_BYTES = 4 << 20        # a 128k-token prompt as JSON token ids fits
# The deepest request OpenAI's API needs is ~6 (messages -> message -> content parts ->
# part); json.loads recurses per level and fails past ~1,000 with RecursionError.
MAX_JSON_DEPTH = 32
BODY_TIMEOUT_S = 30.0           # the whole body, from its first byte read
HEADER_TIMEOUT_S = 10.0         # each request's headers, from the connection or last response
MAX_CONNECTIONS = 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions


class ApiError(Exception):
    """One OpenAI error object and its HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# --- Request bodies -> (prompt, SamplingParams) ------------------------------------------

def _field(body: dict, name: str, kinds: tuple, default=None, *, what: str):
    """body[name] if it has one of `kinds` (bool is never a number), else a 400 naming it."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise ApiError(400, f"'{name}' must be {what}, got {json.dumps(value)[:80]}", param=name)
    return value


def _number(body, name, default=None):
    return _field(body, name, (int, float), default, what="a number")


def _int(body, name, default=None):
    return _field(body, name, (int,), default, what="an integer")


def completion_logprob_fields(body: dict) -> tuple[dict, bool]:
    """/v1/completions' `logprobs` (an int k: the top k of each token) and `echo` (the prompt
    in the text, and with logprobs the prompt's logprobs): (SamplingParams fields, echo)."""
    # false: off, as some clients send it (the API's type is an integer or null).
    logprobs = None if body.get("logprobs") is False else _int(body, "logprobs", None)
    echo = _field(body, "echo", (bool,), False, what="a boolean")
    return {"logprobs": logprobs, "prompt_logprobs": logprobs if echo else None}, echo


def chat_logprob_fields(body: dict) -> dict:
    """/v1/chat/completions' `logprobs` (a boolean) and `top_logprobs` (an int k <= 20)."""
    wanted = _field(body, "logprobs", (bool,), False, what="a boolean")
    top = _int(body, "top_logprobs", None)
    if top is not None and not wanted:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise ApiError(400, f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}",
                       param="top_logprobs")
    return {"logprobs": (top or 0) if wanted else None}


def sampling_params_from(body: dict, *, default_max_tokens: int | None, **fields
                         ) -> tuple[SamplingParams, bool, bool, bool]:
    """(SamplingParams, stream, include_usage, fill_room); 400 on a bad or unsupported field.
    fields: more SamplingParams fields, from the endpoint's own parsing (logprobs).

    fill_room: default_max_tokens is None and the body names no max_tokens, so `submit`
    gives the request all the room its prompt leaves in the context (chat's default)."""
    # Fields asking for what this server cannot do; their "off" values are accepted.
    for unsupported, off in [("best_of", (1,)), ("suffix", ("",)),
                             ("tools", ([],)), ("logit_bias", ({},))]:
        value = body.get(unsupported)
        if value is not None and not (value in off and type(value) is type(off[0])):
            raise ApiError(400, f"'{unsupported}' is not supported by this server",
                           param=unsupported)
    for penalty in ("presence_penalty", "frequency_penalty"):
        if _number(body, penalty, 0) != 0:
            raise ApiError(400, f"'{penalty}' is not supported (must be 0)", param=penalty)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    stop_token_ids = _field(body, "stop_token_ids", (list,), [], what="a list of token ids")
    if not all(validation.is_token_id(t) for t in stop_token_ids):
        raise ApiError(400, "'stop_token_ids' must be a list of integers", param="stop_token_ids")
    max_tokens = _int(body, "max_completion_tokens", None)
    max_tokens = _int(body, "max_tokens", max_tokens)
    stream = _field(body, "stream", (bool,), False, what="a boolean")
    stream_options = _field(body, "stream_options", (dict,), {}, what="an object")
    if stream_options and not stream:
        raise ApiError(400, "'stream_options' needs 'stream': true", param="stream_options")
    kwargs = dict(temperature=_number(body, "temperature", 1.0),
                  top_p=_number(body, "top_p", 1.0), top_k=_int(body, "top_k", 0),
                  seed=_int(body, "seed", None), stop=stop, stop_token_ids=stop_token_ids,
                  ignore_eos=_field(body, "ignore_eos", (bool,), False, what="a boolean"),
                  max_tokens=max_tokens if max_tokens is not None else (default_max_tokens or 1),
                  n=_int(body, "n", 1), **fields)
    if kwargs["temperature"] > 2:
        raise ApiError(400, f"'temperature' must be in [0, 2], got {kwargs['temperature']}",
                       param="temperature")
    try:
        params = SamplingParams(**kwargs)
        validation.check_sampling_limits(params)
    except (ValueError, TypeError) as e:
        raise ApiError(400, str(e), param=str(e).split(" ", 1)[0]) from None
    fill_room = max_tokens is None and default_max_tokens is None
    return params, stream, bool(stream_options.get("include_usage", False)), fill_room


def completion_prompt(body: dict):
    """/v1/completions' `prompt`: a string, token ids, or a list of one of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]            # a batch of one: what the openai client sends for lists
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(validation.is_token_id(t) for t in prompt):
        return validation.TokensPrompt(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "'prompt' may hold one prompt per request (batches of prompts "
                            "are not supported)", param="prompt")
    raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids",
                   param="prompt")


def session_id_from(body: dict, header: str | None) -> str | None:
    """The conversation a request belongs to, for the router's session affinity: the
    X-Session-Id header, else OpenAI's `user` field; None when neither is given."""
    if header:
        return header
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, f"'user' must be a string, got {type(user).__name__}", param="user")
    return user or None


def chat_messages(body: dict) -> list[dict]:
    """/v1/chat/completions' `messages`, content parts of type text joined to one string."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects",
                       param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'",
                           param=f"messages[{i}]")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, f"messages[{i}].content: only parts of type 'text' are "
                                    "supported", param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text "
                                "parts", param=f"messages[{i}].content")
        out.append({**message, "content": content or ""})
    return out


# --- The app --------------------------------------------------------------------------------

def _finish_reason(reason: str | None) -> str | None:
    # "cancelled" and "error" have no OpenAI name; they are passed through as they are.
    return reason


def _generation_error(error: str | None, unavailable: bool) -> ApiError:
    """A request that failed while generating: 503 when its replica failed and no other
    could take it over (the client may retry), else 500."""
    if unavailable:
        return ApiError(503, error or "no replica is available", type="server_error",
                        code="unavailable")
    return ApiError(500, error or "generation failed", type="server_error")


@dataclasses.dataclass
class _Call:
    """What one HTTP request's worker-thread part needs from the event loop, and the handle
    it made (so the loop side can cancel it if the request is abandoned meanwhile)."""

    loop: asyncio.AbstractEventLoop
    may_raise_priority: bool
    handle: RequestHandle | None = None
    session_header: str | None = None       # X-Session-Id


class _Api:
    """The route handlers, bound to one Server."""

    def __init__(self, server, *, access: Access, max_concurrent_requests: int,
                 max_body_bytes: int, model_name: str | None, body_timeout_s: float):
        self.server = server
        self.access = access
        self.max_concurrent = max_concurrent_requests
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.model_name = model_name or server.config.name
        self.open_requests = 0
        self.created = int(time.time())
        self.texts = TokenText(server.tokenizer)

    # ---- plumbing ----

    def check_auth(self, request) -> None:
        if not self.access.admits(request.headers.get("authorization", "")):
            raise ApiError(401, "missing or wrong bearer token (Authorization: Bearer ...)",
                           type="authentication_error", code="invalid_api_key")

    async def read_body(self, request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise ApiError(413, f"request body of {declared} bytes is over the server's limit "
                                f"of {self.max_body_bytes}", code="request_too_large")

        async def read() -> bytes:
            body = bytearray()
            async for chunk in request.stream():
                body += chunk
                if len(body) > self.max_body_bytes:
                    raise ApiError(413, f"request body is over the server's limit of "
                                        f"{self.max_body_bytes} bytes", code="request_too_large")
            return bytes(body)

        try:
            return await asyncio.wait_for(read(), self.body_timeout_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.body_timeout_s} s",
                           code="request_timeout") from None

    def parse_json(self, data: bytes) -> dict:
        """The body as a JSON object (worker thread: a 4 MiB body takes a while)."""
        try:
            parsed = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"malformed JSON body: {e}") from None
        except RecursionError:
            raise ApiError(400, f"the JSON body is nested deeper than {MAX_JSON_DEPTH} "
                                "levels") from None
        if json_depth(parsed, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            raise ApiError(400, f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels")
        if not isinstance(parsed, dict):
            raise ApiError(400, "the JSON body must be an object")
        model = parsed.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", param="model")
        if model and model != self.model_name:
            raise ApiError(404, f"model {model!r} is not served here; this server serves "
                                f"{self.model_name!r}", param="model", code="model_not_found")
        return parsed

    def priority(self, body: dict, call: _Call) -> int:
        priority = _int(body, "priority", validation.DEFAULT_PRIORITY)
        try:
            self.server.limits.check_priority(priority, may_raise=call.may_raise_priority)
        except validation.PriorityNotAllowed as e:
            raise ApiError(403, str(e), type="permission_error", param="priority",
                           code="priority_not_allowed") from None
        except ValueError as e:
            raise ApiError(400, str(e), param="priority") from None
        return priority

    def prompt_ids(self, prompt) -> list[int]:
        try:
            return validation.prompt_token_ids(
                prompt, tokenizer=self.server.tokenizer, vocab_size=self.server.config.vocab_size,
                model_name=self.server.config.name)
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e), param="prompt") from None

    def submit(self, call: _Call, ids: list[int], params: SamplingParams, fill_room: bool,
               priority: int, session_id: str | None = None) -> RequestHandle:
        """Queues the request. fill_room: max_tokens is all the room the context leaves
        (chat's default, as vLLM's)."""
        room = self.server.max_model_len - len(ids)
        if room < 1:
            raise ApiError(413, f"the prompt has {len(ids)} tokens; this server's context is "
                                f"{self.server.max_model_len} tokens (room for at least one "
                                "output token is needed)",
                           code="context_length_exceeded")
        if fill_room:
            params = dataclasses.replace(params, max_tokens=room)
        elif len(ids) + params.max_tokens > self.server.max_model_len:
            raise ApiError(413, f"prompt of {len(ids)} tokens + max_tokens={params.max_tokens} "
                                f"exceeds this server's context of {self.server.max_model_len} "
                                "tokens", param="max_tokens", code="context_length_exceeded")
        try:
            call.handle = self.server.submit(validation.TokensPrompt(ids), params,
                                             priority=priority, session_id=session_id,
                                             _loop=call.loop)
            return call.handle
        except CapacityError as e:
            raise ApiError(413, str(e), param="max_tokens",
                           code="context_length_exceeded") from None
        except (ValueError, TypeError) as e:
            raise ApiError(400, str(e)) from None
        except RuntimeError as e:      # the server is closing, or no replica is healthy
            raise ApiError(503, str(e), type="server_error", code="unavailable") from None

    async def run(self, request, build) -> Any:
        """Auth, body, then on a worker thread `build(body, call) -> (handle, stream,
        include_usage, render)`, then a JSON or an SSE response; any ApiError on the way
        becomes its error object."""
        try:
            self.check_auth(request)
            data = await self.read_body(request)
            if self.open_requests >= self.max_concurrent:
                raise ApiError(429, f"the server has {self.open_requests} requests open, its "
                                    "limit; retry later", type="rate_limit_error",
                               code="overloaded")
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)
        # The slot is taken here, on the loop, so worker threads never race for the last one.
        self.open_requests += 1
        call = _Call(asyncio.get_running_loop(), self.access.may_raise_priority(
            request.headers.get("authorization", "")),
            session_header=request.headers.get("x-session-id"))
        try:
            handle, stream, include_usage, render = await run_in_threadpool(
                lambda: build(self.parse_json(data), call))
        except ApiError as e:
            self.open_requests -= 1
            return JSONResponse(e.body(), status_code=e.status)
        except BaseException:
            # Cancelled while the thread ran (the server stopping): nobody will read it.
            self.open_requests -= 1
            if call.handle is not None:
                call.handle.cancel()
            raise
        if stream:
            return _EventStream(self._sse(handle, render, include_usage),
                                on_close=lambda: self._close_stream(handle))
        try:
            output = await _result_or_disconnect(request, handle)
        finally:
            self.open_requests -= 1
        if output is None:                       # the client went away: nobody to answer
            return Response(status_code=499)
        failed = next((o for o in output.outputs if o.finish_reason == "error"), None)
        if failed is not None:
            error = _generation_error(failed.error, failed.unavailable)
            return JSONResponse(error.body(), status_code=error.status)
        return JSONResponse(render.final(output))

    def _close_stream(self, handle: RequestHandle) -> None:
        self.open_requests -= 1
        if not handle.finished:
            handle.cancel()

    async def _sse(self, handle: RequestHandle, render, include_usage: bool
                   ) -> AsyncIterator[str]:
        # Starlette cancels this generator when the client disconnects (ASGI < 2.4 servers,
        # uvicorn's included); `finally` then cancels the request and frees its pages.
        try:
            for chunk in render.start():
                yield _event(chunk)
            num_out, cached = 0, None
            async for delta in handle:
                num_out += len(delta.token_ids)
                if delta.finish_reason == "error":
                    yield _event(_generation_error(delta.error, delta.unavailable).body())
                    break
                if delta.finished and delta.index == 0:
                    cached = delta.metrics.num_cached_tokens
                if delta.text or delta.finished or delta.logprobs:
                    yield _event(render.chunk(delta))
            if include_usage:
                yield _event(render.usage_chunk(
                    _usage(len(handle.prompt_token_ids), num_out, cached)))
            yield "data: [DONE]\n\n"
        finally:
            if not handle.finished:
                handle.cancel()

    # ---- routes ----

    async def completions(self, request):
        def build(body, call):
            priority = self.priority(body, call)
            fields, echo = completion_logprob_fields(body)
            params, stream, usage, fill_room = sampling_params_from(
                body, default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS, **fields)
            prompt = completion_prompt(body)
            ids = self.prompt_ids(prompt)
            handle = self.submit(call, ids, params, fill_room, priority,
                                 session_id_from(body, call.session_header))
            echoed = None
            if echo:
                echoed = prompt if isinstance(prompt, str) else \
                    self.server.tokenizer.decode(ids) if self.server.tokenizer else ""
            return handle, stream, usage, _CompletionRender(self.model_name, handle, self.texts,
                                                            echo=echoed)
        return await self.run(request, build)

    async def chat_completions(self, request):
        def build(body, call):
            priority = self.priority(body, call)
            params, stream, usage, fill_room = sampling_params_from(
                body, default_max_tokens=None, **chat_logprob_fields(body))
            messages = chat_messages(body)
            try:
                ids = list(self.server.chat_prompt(messages).prompt_token_ids)
            except (ValueError, TypeError) as e:
                raise ApiError(400, str(e), param="messages") from None
            except Exception as e:   # noqa: BLE001 - jinja's TemplateError: the messages' fault
                raise ApiError(400, f"cannot apply the chat template: {e}",
                               param="messages") from None
            if not ids:
                raise ApiError(400, "the chat template rendered an empty prompt",
                               param="messages")
            handle = self.submit(call, ids, params, fill_room, priority,
                                 session_id_from(body, call.session_header))
            return handle, stream, usage, _ChatRender(self.model_name, handle, self.texts)
        return await self.run(request, build)

    async def models(self, request):
        try:
            self.check_auth(request)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "medha-jax", "max_model_len": self.server.max_model_len}]})

    async def health(self, request):
        if self.server.closed:
            return JSONResponse({"status": "closing"}, status_code=503)
        unavailable = getattr(self.server, "unavailable", None)     # RayServer has none
        if unavailable is not None:
            return JSONResponse({"status": "unavailable", "error": unavailable},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request):
        # Request counts and latencies say how busy the server is and what its clients do.
        try:
            self.check_auth(request)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return PlainTextResponse(self.server.metrics_text(),
                                 media_type="text/plain; version=0.0.4")


async def _result_or_disconnect(request, handle: RequestHandle):
    """The request's final output, or None (and the request cancelled) if the client
    disconnects first. The body has been read, so `receive` now only reports disconnects."""
    async def collect():
        async for _ in handle:           # to the last sample's final delta
            pass
        return handle.result()

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if work in done:
        return work.result()
    handle.cancel()
    return None


class _EventStream(StreamingResponse):
    """A server-sent-event response that runs on_close however it ends, even when the
    client left before its body was first iterated (the body's own `finally` never runs)."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(body, media_type="text/event-stream",
                         headers={"cache-control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self._on_close()


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
           ) -> dict:
    """OpenAI's usage; completion_tokens over all n choices, cached_tokens of the prompt
    taken from the prefix cache (by the first choice)."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


def _output_usage(output) -> dict:
    return _usage(len(output.prompt_token_ids), sum(len(o.token_ids) for o in output.outputs),
                  output.metrics.num_cached_tokens)


class _CompletionRender:
    """OpenAI `text_completion` objects for one request: n choices.

    echo: the prompt's text, which starts each choice's text (and with logprobs its tokens
    start each choice's logprobs, the prompt logprobs of sample 0, the first one null)."""

    def __init__(self, model: str, handle: RequestHandle, texts: TokenText, *,
                 echo: str | None = None):
        self.model, self.id = model, f"cmpl-{handle.id}"
        self.created = int(time.time())
        self.texts, self.echo = texts, echo
        self.prompt_ids = list(handle.prompt_token_ids)
        self._prompt_logprobs = None
        self._echoed = [False] * handle.n
        self._text_offsets = [0] * handle.n     # a stream's text so far, per choice

    def _obj(self, choices, usage=None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": usage}

    def _choice(self, index: int, text: str, token_ids, logprobs, finish_reason) -> dict:
        ids, entries = list(token_ids), None if logprobs is None else list(logprobs)
        if self.echo is not None and not self._echoed[index]:
            self._echoed[index] = True
            text = self.echo + text
            if entries is not None:
                prompt = self._prompt_logprobs or (None,) * len(self.prompt_ids)
                ids, entries = self.prompt_ids + ids, list(prompt) + entries
        choice_logprobs = None if entries is None else completion_logprobs(
            ids, entries, self.texts, self._text_offsets[index])
        self._text_offsets[index] += len(text)
        return {"index": index, "text": text, "logprobs": choice_logprobs,
                "finish_reason": _finish_reason(finish_reason)}

    def final(self, output) -> dict:
        self._prompt_logprobs = output.prompt_logprobs
        return self._obj([self._choice(o.index, o.text, o.token_ids, o.logprobs,
                                       o.finish_reason) for o in output.outputs],
                         _output_usage(output))

    def start(self):
        return ()

    def chunk(self, delta: StreamDelta) -> dict:
        if delta.prompt_logprobs is not None:   # sample 0's first delta, before any other's
            self._prompt_logprobs = delta.prompt_logprobs
        return self._obj([self._choice(delta.index, delta.text, delta.token_ids,
                                       delta.logprobs, delta.finish_reason)])

    def usage_chunk(self, usage: dict) -> dict:
        return self._obj([], usage)


class _ChatRender:
    """OpenAI `chat.completion` / `chat.completion.chunk` objects for one request: n choices."""

    def __init__(self, model: str, handle: RequestHandle, texts: TokenText):
        self.model, self.id = model, f"chatcmpl-{handle.id}"
        self.created = int(time.time())
        self.texts, self.n = texts, handle.n

    def _obj(self, kind, choices, usage=None) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage}

    def _logprobs(self, entries) -> dict | None:
        return None if entries is None else chat_logprobs(entries, self.texts)

    def final(self, output) -> dict:
        return self._obj("chat.completion", [{
            "index": o.index, "message": {"role": "assistant", "content": o.text},
            "logprobs": self._logprobs(o.logprobs),
            "finish_reason": _finish_reason(o.finish_reason)} for o in output.outputs],
            _output_usage(output))

    def start(self):
        # The first chunk of each choice names the role, as OpenAI's does.
        return tuple(self._obj("chat.completion.chunk", [{
            "index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}]) for index in range(self.n))

    def chunk(self, delta: StreamDelta) -> dict:
        return self._obj("chat.completion.chunk", [{
            "index": delta.index, "delta": {"content": delta.text} if delta.text else {},
            "logprobs": self._logprobs(delta.logprobs),
            "finish_reason": _finish_reason(delta.finish_reason)}])

    def usage_chunk(self, usage: dict) -> dict:
        return self._obj("chat.completion.chunk", [], usage)


def make_app(server, *, token: str | None = None, max_concurrent_requests: int = 256,
             max_body_bytes: int = MAX_BODY_BYTES, model_name: str | None = None,
             priority_tokens: tuple[str, ...] = (), body_timeout_s: float = BODY_TIMEOUT_S):
    """The Starlette app serving `server` (mount it in your own ASGI server, or use
    HttpServer). priority_tokens: see serving.auth."""
    if not body_timeout_s > 0:
        raise ValueError(f"body_timeout_s must be > 0, got {body_timeout_s!r}")
    api = _Api(server, access=Access.of(token, priority_tokens),
               max_concurrent_requests=max_concurrent_requests, max_body_bytes=max_body_bytes,
               model_name=model_name, body_timeout_s=body_timeout_s)

    async def http_error(request, exc: HTTPException):
        # Unknown routes and methods answer in the same shape as every other error.
        return JSONResponse(ApiError(exc.status_code, f"{request.method} {request.url.path}: "
                                     f"{exc.detail}").body(), status_code=exc.status_code)

    app = Starlette(exception_handlers={HTTPException: http_error}, routes=[
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
    ])
    app.state.api = api
    return app


def json_depth(value, limit: int) -> int:
    """How deeply `value`'s lists and objects nest (a scalar: 0), counted up to limit + 1."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if not isinstance(node, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def _header_deadline_protocol(header_timeout_s: float):
    """uvicorn's h11 protocol with a deadline on each request's headers, counted from the
    connection (or the previous response): uvicorn has none, so a client that connects and
    sends nothing, or a header a byte at a time, would hold a connection slot (and, at
    `limit_concurrency`, lock every other client out) forever."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineH11(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout_s, self._late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _late(self) -> None:
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:     # a request's headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()

    return HeaderDeadlineH11


class HttpServer:
    """uvicorn serving `make_app(server)` on its own thread and event loop.

    host defaults to loopback: 0.0.0.0 exposes the API (and, without a token, the model) to
    the network, in clear text: put a TLS-terminating proxy in front. port=0 picks a free
    port (see `port`). max_connections: open connections at most (uvicorn's
    limit_concurrency; past it new requests get 503); header_timeout_s and body_timeout_s:
    how long a client may take to send a request's headers and its body."""

    def __init__(self, server, *, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, max_concurrent_requests: int = 256,
                 max_body_bytes: int = MAX_BODY_BYTES, model_name: str | None = None,
                 priority_tokens: tuple[str, ...] = (), max_connections: int = MAX_CONNECTIONS,
                 header_timeout_s: float = HEADER_TIMEOUT_S,
                 body_timeout_s: float = BODY_TIMEOUT_S):
        import uvicorn

        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if not header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s!r}")
        self.app = make_app(server, token=token, max_concurrent_requests=max_concurrent_requests,
                            max_body_bytes=max_body_bytes, model_name=model_name,
                            priority_tokens=priority_tokens, body_timeout_s=body_timeout_s)
        # Bound here, so the port is known (and a taken one fails) before serving starts.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = host, self._socket.getsockname()[1]
        self._uvicorn = uvicorn.Server(uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="off",
            timeout_graceful_shutdown=5,
            # uvicorn counts the asking connection too: N + 1 serves N connections.
            limit_concurrency=max_connections + 1,
            http=_header_deadline_protocol(header_timeout_s)))
        self._thread = threading.Thread(
            target=lambda: self._uvicorn.run(sockets=[self._socket]),
            name="medha-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started and self._thread.is_alive():
            if time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start in 30 s")
            time.sleep(0.01)
        if not self._uvicorn.started:
            raise RuntimeError("the HTTP server failed to start (see the log above)")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        """Stops accepting, lets open responses finish (up to uvicorn's grace), joins."""
        self._uvicorn.should_exit = True
        self._thread.join(timeout)
        self._socket.close()

    def __enter__(self) -> "HttpServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
