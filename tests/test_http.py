"""The OpenAI-compatible HTTP API on loopback, driven by the official `openai` client and by
raw HTTP (tiny model, CPU).

Completions and chat, streaming and not, equal the Python API's greedy outputs; bad inputs
(malformed JSON, wrong types, too long, wrong token, too many open requests) each get an
OpenAI error object with its status while another request completes; a client that
disconnects (streaming or not) cancels its request and frees its pages.
"""

import http.client as httplib
import json
import socket
import threading
import time

import openai
import pytest

from medha_jax import SamplingParams
from serving.http_server import HttpServer
from serving.server import TokensPrompt
from tests.test_cli import model_dir  # noqa: F401 - a fixture, for the CLI test
from tests.test_server import make_tiny_server, wait_until_idle

TOKEN = "test-token"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def server():
    with make_tiny_server() as s:
        s.tokenizer.chat_template = CHATML
        yield s


@pytest.fixture(scope="module")
def http(server):
    with HttpServer(server, token=TOKEN, max_concurrent_requests=4) as h:
        yield h


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url=f"{http.url}/v1", api_key=TOKEN, max_retries=0, timeout=60)


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n)


def raw(http, method, path, body=None, *, token=TOKEN, headers=None):
    """(status, parsed JSON or text) of one raw HTTP request."""
    conn = http_connection(http)
    data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
    hdrs = {"content-type": "application/json", **(headers or {})}
    if token:
        hdrs["authorization"] = f"Bearer {token}"
    conn.request(method, path, body=data, headers=hdrs)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    try:
        return resp.status, json.loads(text)
    except json.JSONDecodeError:
        return resp.status, text


def http_connection(h):
    return httplib.HTTPConnection(h.host, h.port, timeout=60)


# --- The openai client ------------------------------------------------------------------------

def test_completion_equals_the_python_api(server, client):
    out = client.completions.create(model=server.config.name, prompt="Hello there",
                                    max_tokens=10, temperature=0)
    want = server.generate("Hello there", greedy(10))
    choice = out.choices[0]
    assert choice.text == want.text
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(want.prompt_token_ids)
    assert out.usage.completion_tokens == 10
    assert out.object == "text_completion"


def test_completion_stream_concatenates_to_the_whole(server, client):
    want = server.generate("Stream me", greedy(12))
    chunks = list(client.completions.create(
        model=server.config.name, prompt="Stream me", max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_completion_of_token_ids(server, client):
    ids = [72, 105, 33, 200]
    out = client.completions.create(model=server.config.name, prompt=ids, max_tokens=6,
                                    temperature=0)
    assert out.choices[0].text == server.generate(TokensPrompt(ids), greedy(6)).text


def test_chat_equals_server_chat(server, client):
    want = server.chat(MESSAGES, greedy(9))
    out = client.chat.completions.create(model=server.config.name, messages=MESSAGES,
                                         max_tokens=9, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want.text
    # The prompt is the rendered template, tokenized without an added BOS.
    rendered = server.tokenizer.apply_chat_template(MESSAGES)
    assert out.usage.prompt_tokens == len(server.tokenizer.encode(rendered, add_bos=False))


def test_chat_stream(server, client):
    want = server.chat(MESSAGES, greedy(9))
    chunks = list(client.chat.completions.create(
        model=server.config.name, messages=MESSAGES, max_tokens=9, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_without_max_tokens_fills_the_context(server, client):
    out = client.chat.completions.create(model=server.config.name, messages=MESSAGES,
                                         temperature=0)
    assert out.usage.prompt_tokens + out.usage.completion_tokens == server.max_model_len


def test_models_health_metrics(server, client, http):
    assert [m.id for m in client.models.list().data] == [server.config.name]
    assert raw(http, "GET", "/health", token=None) == (200, {"status": "ok"})
    # /metrics says how busy the server is and what its clients do: the token guards it.
    status, got = raw(http, "GET", "/metrics", token=None)
    assert status == 401 and got["error"]["type"] == "authentication_error"
    status, text = raw(http, "GET", "/metrics")
    assert status == 200 and "medha_requests_finished" in text


def test_openai_client_errors(server, client, http):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=server.config.name, prompt="x", temperature=5)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4", prompt="x")
    bad = openai.OpenAI(base_url=f"{http.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# --- logprobs and n -------------------------------------------------------------------------

def close(a, b, tol=1e-4):
    return a is None and b is None or abs(a - b) < tol


def test_completion_logprobs_and_n_equal_the_python_api(server, client):
    prompt = "Hello there"
    want = server.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5, logprobs=3,
                                                  prompt_logprobs=3))
    out = client.completions.create(model=server.config.name, prompt=prompt, max_tokens=5,
                                    temperature=0, logprobs=3, n=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 10
    texts = [server.tokenizer.token_bytes(t).decode("utf-8", "replace") for t in want.token_ids]
    for choice in out.choices:
        lp = choice.logprobs
        assert choice.text == want.text and lp.tokens == texts
        assert all(close(a, e.logprob) for a, e in zip(lp.token_logprobs, want.logprobs,
                                                         strict=True))
        for top, token in zip(lp.top_logprobs, lp.tokens, strict=True):
            # The token and its top 3, keyed by text: bytes of partial characters share
            # one text (U+FFFD), so keys may merge.
            assert token in top and len(top) <= 4
        assert lp.text_offset == [sum(map(len, texts[:i])) for i in range(5)]
    # echo: the prompt's text and logprobs first, the first token's null.
    echoed = client.completions.create(model=server.config.name, prompt=prompt, max_tokens=5,
                                       temperature=0, logprobs=3, echo=True).choices[0]
    assert echoed.text == prompt + want.text
    n_prompt = len(want.prompt_token_ids)
    assert len(echoed.logprobs.tokens) == n_prompt + 5
    assert echoed.logprobs.token_logprobs[0] is None and echoed.logprobs.top_logprobs[0] is None
    expected = [None] + [e.logprob for e in want.prompt_logprobs[1:]] + \
        [e.logprob for e in want.logprobs]
    assert all(close(a, b) for a, b in zip(echoed.logprobs.token_logprobs, expected, strict=True))


def test_completion_stream_of_n_choices_with_logprobs(server, client):
    want = server.generate("Stream me", SamplingParams(temperature=0.0, max_tokens=6,
                                                       logprobs=1))
    chunks = list(client.completions.create(
        model=server.config.name, prompt="Stream me", max_tokens=6, temperature=0, n=3,
        logprobs=1, stream=True, stream_options={"include_usage": True}))
    text, logprobs, finished = {}, {}, []
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices                      # each chunk is one choice's
        text[choice.index] = text.get(choice.index, "") + choice.text
        logprobs.setdefault(choice.index, []).extend(choice.logprobs.token_logprobs)
        if choice.finish_reason:
            finished.append(choice.index)
    assert sorted(finished) == [0, 1, 2] and chunks[-1].usage.completion_tokens == 18
    for index in range(3):
        assert text[index] == want.text
        assert all(close(a, e.logprob) for a, e in zip(logprobs[index], want.logprobs,
                                                        strict=True))


def test_chat_logprobs_and_n_stream_and_not(server, client):
    want = server.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=6, logprobs=2))
    kwargs = dict(model=server.config.name, messages=MESSAGES, max_tokens=6, temperature=0,
                  n=2, logprobs=True, top_logprobs=2)
    out = client.chat.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens == 12
    for choice in out.choices:
        content = choice.logprobs.content
        assert choice.message.content == want.text and len(content) == 6
        for item, entry in zip(content, want.logprobs, strict=True):
            assert item.token == server.tokenizer.decode([entry.token_id])
            assert bytes(item.bytes) == server.tokenizer.token_bytes(entry.token_id)
            assert close(item.logprob, entry.logprob)
            assert [close(t.logprob, lp) for t, (_, lp) in zip(item.top_logprobs, entry.top,
                                                                strict=True)] == [True] * 2
    streamed = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                streamed.setdefault(choice.index, []).extend(choice.logprobs.content)
    assert sorted(streamed) == [0, 1]
    for index in (0, 1):
        assert [(i.token, i.logprob) for i in streamed[index]] == \
            [(i.token, i.logprob) for i in out.choices[index].logprobs.content]


def test_random_choices_differ(server, client):
    out = client.chat.completions.create(model=server.config.name, messages=MESSAGES,
                                         max_tokens=8, temperature=1.0, n=3)
    assert len({c.message.content for c in out.choices}) == 3


# --- Raw HTTP bad inputs, while another request runs --------------------------------------

@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "malformed JSON"),
    (b"[1, 2]", 400, "must be an object"),
    ({"prompt": "x", "temperature": "hot"}, 400, "'temperature' must be a number"),
    ({"prompt": "x", "max_tokens": True}, 400, "'max_tokens' must be an integer"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be an int >= 1"),
    ({"prompt": "x", "stop": [1]}, 400, "'stop' must be a string"),
    ({"prompt": 7}, 400, "'prompt' must be"),
    ({"prompt": [1, 300]}, 400, "outside the vocabulary"),
    ({"prompt": "x", "n": 0}, 400, "n must be an int in [1, 64]"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs must be None or an int in [0, 20]"),
    ({"prompt": "x", "best_of": 2}, 400, "'best_of' is not supported"),
    ({"prompt": "x" * 300}, 413, "context"),
    ({"prompt": "x" * 200, "max_tokens": 100}, 413, "exceeds"),
])
def test_bad_inputs_get_error_objects_while_others_complete(server, http, body, status, needle):
    want = server.generate("keep going", greedy(24))
    result = {}

    def other():
        result["out"] = raw(http, "POST", "/v1/completions",
                            {"prompt": "keep going", "max_tokens": 24, "temperature": 0})

    t = threading.Thread(target=other)
    t.start()
    got_status, got = raw(http, "POST", "/v1/completions", body)
    t.join(60)
    assert got_status == status, got
    assert needle in got["error"]["message"]
    assert set(got["error"]) == {"message", "type", "param", "code"}
    ok_status, ok = result["out"]
    assert ok_status == 200 and ok["choices"][0]["text"] == want.text


def test_deeply_nested_json_is_400_not_500(http):
    for body in [b"[" * 100_000 + b"]" * 100_000,                  # RecursionError in json
                 json.dumps({"prompt": "x", "stop": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[
                     []]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]})]:    # past MAX_JSON_DEPTH
        status, got = raw(http, "POST", "/v1/completions", body)
        assert status == 400 and "nested deeper than 32 levels" in got["error"]["message"], got


def test_parsing_tokenizing_and_chat_rendering_run_off_the_event_loop(server, http):
    """The event loop (thread "medha-http") serves every open stream: a 4 MiB prompt's
    tokenization or a chat template's rendering there would stall them all."""
    seen = []
    tokenizer = server.tokenizer
    encode, render = tokenizer.encode, tokenizer.apply_chat_template

    def spy(fn):
        def wrapped(*args, **kwargs):
            seen.append((fn.__name__, threading.current_thread().name))
            return fn(*args, **kwargs)
        return wrapped

    tokenizer.encode, tokenizer.apply_chat_template = spy(encode), spy(render)
    try:
        assert raw(http, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200
        assert raw(http, "POST", "/v1/chat/completions",
                   {"messages": MESSAGES, "max_tokens": 2})[0] == 200
    finally:
        del tokenizer.encode, tokenizer.apply_chat_template
    assert {name for name, _ in seen} >= {"encode", "apply_chat_template"}
    assert [thread for _, thread in seen if thread == "medha-http"] == [], seen


def test_priority_above_the_default_needs_a_priority_token(server):
    with HttpServer(server, token=TOKEN, priority_tokens=("vip",)) as h:
        body = {"prompt": "x", "max_tokens": 2, "temperature": 0}
        status, got = raw(h, "POST", "/v1/completions", {**body, "priority": -3})
        assert status == 403 and got["error"]["param"] == "priority", got
        assert "priority token" in got["error"]["message"]
        for priority, token in [(3, TOKEN), (-3, "vip"), (0, "vip")]:
            status, got = raw(h, "POST", "/v1/completions", {**body, "priority": priority},
                              token=token)
            assert status == 200, (priority, token, got)
        for priority, needle in [(-2**31, "outside this server's range [-100, 100]"),
                                 ("high", "'priority' must be an integer")]:
            status, got = raw(h, "POST", "/v1/chat/completions",
                              {"messages": MESSAGES, "priority": priority}, token="vip")
            assert status == 400 and needle in got["error"]["message"], got


def _send_raw(h, data: bytes) -> socket.socket:
    sock = socket.create_connection((h.host, h.port), timeout=30)
    sock.sendall(data)
    return sock


def _closed_within(sock, seconds) -> bytes | None:
    """What the server sent before closing the connection, or None if it is still open."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except socket.timeout:
        return None
    return got


def test_slow_headers_slow_bodies_and_connection_cap(server):
    """Half-open connections are closed after header_timeout_s, a body that stalls gets 408
    after body_timeout_s, and neither locks a well-formed client out for longer."""
    with HttpServer(server, max_connections=3, header_timeout_s=0.5, body_timeout_s=0.5) as h:
        half_open = [_send_raw(h, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
                     for _ in range(2)]
        stalled = _send_raw(h, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                               b"content-type: application/json\r\ncontent-length: 100\r\n"
                               b"\r\n{\"prompt\":")
        # Three connections are open: the cap. A fourth client is refused while they hold.
        status, _ = raw(h, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1},
                        token=None)
        assert status == 503
        for sock in half_open:
            assert _closed_within(sock, 10) == b""
        answer = _closed_within(stalled, 10)
        assert answer is not None and answer.startswith(b"HTTP/1.1 408"), answer
        assert b"did not arrive within 0.5 s" in answer
        for sock in half_open + [stalled]:
            sock.close()
        status, got = raw(h, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 1},
                          token=None)
        assert status == 200 and got["choices"][0]["finish_reason"] == "length"
    assert wait_until_idle(server)


def test_bad_chat_messages(http):
    for messages, needle in [("hi", "'messages' must be"), ([{"content": "x"}], "'role'"),
                             ([{"role": "user", "content": 3}], "content")]:
        status, got = raw(http, "POST", "/v1/chat/completions", {"messages": messages})
        assert status == 400 and needle in got["error"]["message"], got
    for extra, needle in [({"top_logprobs": 2}, "needs 'logprobs': true"),
                          ({"logprobs": True, "top_logprobs": 21}, "must be in [0, 20]"),
                          ({"logprobs": 3}, "'logprobs' must be a boolean")]:
        status, got = raw(http, "POST", "/v1/chat/completions", {"messages": MESSAGES, **extra})
        assert status == 400 and needle in got["error"]["message"], got


def test_body_over_the_limit_is_413(server):
    with HttpServer(server, max_body_bytes=1000) as h:
        status, got = raw(h, "POST", "/v1/completions", {"prompt": "y" * 2000}, token=None)
    assert status == 413 and got["error"]["code"] == "request_too_large"


def test_unknown_routes_and_methods_are_error_objects(http):
    status, got = raw(http, "GET", "/v1/completions")
    assert status == 405 and "Method Not Allowed" in got["error"]["message"]
    status, got = raw(http, "POST", "/v1/embeddings", {"input": "x"})
    assert status == 404 and "/v1/embeddings" in got["error"]["message"]


def test_missing_token_is_401(http):
    status, got = raw(http, "POST", "/v1/completions", {"prompt": "x"}, token=None)
    assert status == 401 and got["error"]["type"] == "authentication_error"


def test_too_many_open_requests_is_429(server):
    with HttpServer(server, max_concurrent_requests=1) as h:
        conn = http_connection(h)
        conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": "slow", "max_tokens": 200, "stream": True}),
            {"content-type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        resp.readline()                       # the stream has started: one request open
        status, got = raw(h, "POST", "/v1/completions", {"prompt": "x"}, token=None)
        assert status == 429 and got["error"]["type"] == "rate_limit_error"
        conn.close()
        assert wait_until_idle(server)


# --- Disconnects free pages -------------------------------------------------------------------

def _open_and_drop(http, body, read_first_line: bool):
    sock = socket.create_connection((http.host, http.port))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 + f"authorization: Bearer {TOKEN}\r\ncontent-length: {len(data)}\r\n\r\n".encode()
                 + data)
    if read_first_line:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_and_frees_pages(server, http, stream):
    finished = server.metrics.requests_finished
    before = finished.labels(finish_reason="cancelled")._value.get()
    _open_and_drop(http, {"prompt": "long", "max_tokens": 240, "stream": stream},
                   read_first_line=stream)
    deadline = time.monotonic() + 30
    while (finished.labels(finish_reason="cancelled")._value.get() == before
           and time.monotonic() < deadline):
        time.sleep(0.02)
    assert finished.labels(finish_reason="cancelled")._value.get() == before + 1
    assert wait_until_idle(server)


# --- The command ------------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_serves_http_only_with_a_token_and_stops_on_sigterm(model_dir):
    import re
    import signal
    import subprocess
    import sys

    from tests.test_cli import SMALL_ENGINE

    proc = subprocess.Popen(
        [sys.executable, "-m", "serving.cli", "serve", "--model", model_dir, "--no-grpc",
         "--http-port", "0", "--token", "tok", *SMALL_ENGINE],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        banner = ""
        for line in proc.stdout:                  # blocks until the server is up
            if line.startswith("serving "):
                banner = line
                break
        match = re.search(r" on (http://127\.0\.0\.1:\d+) \(OpenAI API: .*\) \(bearer token "
                          r"required\)", banner)
        assert match, f"banner {banner!r}; stderr: {proc.stderr.read() if proc.poll() else ''}"
        client = openai.OpenAI(base_url=f"{match.group(1)}/v1", api_key="tok", max_retries=0)
        assert [m.id for m in client.models.list().data] == [model_dir]   # --model's value
        out = client.completions.create(model=model_dir, prompt="hi", max_tokens=3,
                                        temperature=0)
        assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_session_from_x_session_id_or_user_and_no_replica_is_503(server, http, monkeypatch,
                                                                 record_sessions):
    """The router's session comes from the X-Session-Id header, else OpenAI's `user`; a
    request no healthy replica can take is 503 "unavailable", before or while it generates."""
    from medha_jax.cluster.router import NoHealthyReplica
    from serving.http_server import _generation_error

    sessions = record_sessions(server)
    body = {"prompt": "hi", "max_tokens": 2, "temperature": 0}
    assert raw(http, "POST", "/v1/completions", {**body, "user": "alice"})[0] == 200
    assert raw(http, "POST", "/v1/completions", {**body, "user": "alice"},
               headers={"X-Session-Id": "chat-7"})[0] == 200
    assert raw(http, "POST", "/v1/chat/completions",
               {"messages": MESSAGES, "max_tokens": 2, "temperature": 0})[0] == 200
    assert sessions == ["alice", "chat-7", None]
    status, got = raw(http, "POST", "/v1/completions", {**body, "user": 3})
    assert status == 400 and got["error"]["param"] == "user"

    def no_replica(*args, **kwargs):
        raise NoHealthyReplica("none of the 2 replicas is healthy")
    monkeypatch.setattr(server, "submit", no_replica)
    status, got = raw(http, "POST", "/v1/completions", body)
    assert status == 503 and got["error"]["code"] == "unavailable"
    assert "none of the 2 replicas" in got["error"]["message"]
    assert _generation_error("replica 1 is down", True).status == 503
    assert _generation_error("step failed", False).status == 500
