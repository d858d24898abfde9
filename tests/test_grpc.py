"""The gRPC service with a real client on loopback: streaming, errors, cancellation and
deadlines freeing pages, health checks, bearer tokens, message limits, metrics."""

import re
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.grpc_service import GrpcServer
from serving.proto import medha_pb2, medha_pb2_grpc
from tests.test_server import GREEDY, make_tiny_server, wait_until_idle


@pytest.fixture(scope="module")
def server():
    with make_tiny_server() as s:
        yield s


@pytest.fixture(scope="module")
def endpoint(server):
    with GrpcServer(server, port=0) as g:
        yield g


@pytest.fixture
def stub(endpoint):
    with grpc.insecure_channel(endpoint.address) as channel:
        yield medha_pb2_grpc.MedhaStub(channel)


def request(prompt, max_tokens=12, temperature=0.0, **kwargs):
    sampling = medha_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature)
    if isinstance(prompt, str):
        return medha_pb2.GenerateRequest(text=prompt, sampling=sampling, **kwargs)
    return medha_pb2.GenerateRequest(token_ids=medha_pb2.TokenIds(ids=prompt), sampling=sampling,
                                     **kwargs)


def test_binds_to_loopback_by_default(endpoint):
    assert endpoint.address == f"127.0.0.1:{endpoint.port}" and endpoint.port > 0


def test_stream_concatenates_to_the_python_api_output(server, stub):
    for prompt in ([4, 5, 6, 7], "Grüß dich"):
        expected = server.generate([prompt], GREEDY)[0]
        responses = list(stub.Generate(request(prompt)))
        assert all(not r.finished for r in responses[:-1]) and responses[-1].finished
        final = responses[-1]
        assert final.finish_reason == "length" and final.error == ""
        assert tuple(t for r in responses for t in r.token_ids) == expected.token_ids
        assert "".join(r.text for r in responses) == expected.text
        assert final.metrics.num_output_tokens == 12
        assert final.metrics.num_prompt_tokens == len(expected.prompt_token_ids)
        assert final.metrics.ttft_s > 0


def test_request_id_is_echoed_and_stop_strings_work(server, stub):
    expected = server.generate("abc", GREEDY).text
    stop = next(c for c in expected[2:] if c.isprintable() and c != "\ufffd")
    msg = request("abc", request_id="mine")
    msg.sampling.stop.append(stop)
    responses = list(stub.Generate(msg))
    assert {r.request_id for r in responses} == {"mine"}
    assert responses[-1].finish_reason == "stop"
    assert "".join(r.text for r in responses) == expected[:expected.index(stop)]


def test_logprobs_prompt_logprobs_and_n(server, stub):
    from medha_jax import SamplingParams
    from serving.server import TokensPrompt

    prompt = [4, 5, 6, 7, 8]
    want = server.generate(TokensPrompt(prompt), SamplingParams(
        temperature=0.0, max_tokens=5, logprobs=2, prompt_logprobs=1))
    msg = request(prompt, max_tokens=5)
    msg.sampling.n, msg.sampling.logprobs, msg.sampling.prompt_logprobs = 2, 2, 1
    responses = list(stub.Generate(msg))
    assert sorted(r.index for r in responses if r.finished) == [0, 1]
    for index in (0, 1):
        mine = [r for r in responses if r.index == index]
        assert tuple(t for r in mine for t in r.token_ids) == want.token_ids
        entries = [e for r in mine for e in r.logprobs]
        for got, entry in zip(entries, want.logprobs, strict=True):
            assert got.token_id == entry.token_id and abs(got.logprob - entry.logprob) < 1e-4
            assert [(t.token_id, round(t.logprob, 4)) for t in got.top] == \
                [(t, round(lp, 4)) for t, lp in entry.top]
    (with_prompt,) = [r for r in responses if r.prompt_logprobs]
    assert with_prompt.index == 0
    assert [e.token_id for e in with_prompt.prompt_logprobs] == prompt[1:]
    for got, entry in zip(with_prompt.prompt_logprobs, want.prompt_logprobs[1:], strict=True):
        assert abs(got.logprob - entry.logprob) < 1e-4


@pytest.mark.parametrize("msg, code, field", [
    (medha_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (request(""), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    (request([1, 999]), grpc.StatusCode.INVALID_ARGUMENT, r"prompt\[1\] = 999"),
    (request([1, 2], temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (request([1, 2], max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (request([1] * 300), grpc.StatusCode.INVALID_ARGUMENT, "max_model_len"),
    (request([1, 2], slo=medha_pb2.SLO(ttft_s=0, tpot_s=1)), grpc.StatusCode.INVALID_ARGUMENT,
     "ttft_s"),
    # An SLO that would make every batch it rides in ~0 s long (or one never due).
    (request([1, 2], slo=medha_pb2.SLO(ttft_s=1, tpot_s=1e-9)), grpc.StatusCode.INVALID_ARGUMENT,
     r"slo.tpot_s=1e-09 is outside this server's range \[0.02, 60.0\]"),
    (request([1, 2], slo=medha_pb2.SLO(ttft_s=1e9, tpot_s=1)), grpc.StatusCode.INVALID_ARGUMENT,
     r"slo.ttft_s=1e\+09 is outside"),
    (request([1, 2], priority=-2**31), grpc.StatusCode.INVALID_ARGUMENT,
     r"priority=-2147483648 is outside this server's range \[-100, 100\]"),
    # No priority token: a client may not put itself ahead of the default class.
    (request([1, 2], priority=-1), grpc.StatusCode.PERMISSION_DENIED,
     r"priority=-1 is more important than the default"),
])
def test_bad_requests_get_a_status_naming_the_field(stub, msg, code, field):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(msg))
    assert e.value.code() == code
    assert re.search(field, e.value.details()), e.value.details()


def test_client_cancel_frees_the_pages(server, stub):
    call = stub.Generate(request(list(range(40)), max_tokens=200))
    first = next(call)
    assert first.token_ids and server.num_free_pages < server.num_total_pages
    call.cancel()
    assert wait_until_idle(server)
    # The server is still fine afterwards.
    assert list(stub.Generate(request([1, 2], max_tokens=2)))[-1].finished


def test_deadline_cancels_the_request(server, stub, monkeypatch):
    real_dispatch = server.engine.dispatch

    def slow_dispatch(batch):     # 240 steps of >= 10 ms cannot beat a 0.5 s deadline
        time.sleep(0.01)
        return real_dispatch(batch)

    monkeypatch.setattr(server.engine, "dispatch", slow_dispatch)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request(list(range(10)), max_tokens=240), timeout=0.5))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until_idle(server)


def test_metrics_rpc_returns_prometheus_text(stub):
    list(stub.Generate(request([3, 3], max_tokens=2)))
    text = stub.Metrics(medha_pb2.MetricsRequest()).text
    assert "medha_ttft_seconds_count" in text and "medha_kv_pages_in_use" in text


def test_health_check_and_watch(endpoint):
    with grpc.insecure_channel(endpoint.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        for service in ("", "medha.v1.Medha"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == serving
        with pytest.raises(grpc.RpcError) as e:
            health.Check(health_pb2.HealthCheckRequest(service="nope"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == serving
        watch.cancel()


def test_stop_reports_not_serving_to_watchers(server):
    g = GrpcServer(server, port=0)
    with grpc.insecure_channel(g.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        g.health.enter_graceful_shutdown()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()
    g.stop(grace=0)


def test_bearer_token(server):
    with GrpcServer(server, port=0, token="s3cret") as g, \
            grpc.insecure_channel(g.address) as channel:
        stub = medha_pb2_grpc.MedhaStub(channel)
        for metadata in [None, (("authorization", "Bearer wrong"),),
                         (("authorization", "s3cret"),)]:
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request([1, 2], max_tokens=2), metadata=metadata))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            stub.Metrics(medha_pb2.MetricsRequest())
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = list(stub.Generate(request([1, 2], max_tokens=2),
                                metadata=(("authorization", "Bearer s3cret"),)))
        assert ok[-1].finished and ok[-1].finish_reason == "length"
        # Health probes carry no token.
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_only_a_priority_token_raises_priority(server):
    with GrpcServer(server, port=0, token="s3cret", priority_tokens=("vip",)) as g, \
            grpc.insecure_channel(g.address) as channel:
        stub = medha_pb2_grpc.MedhaStub(channel)
        user, vip = (("authorization", "Bearer s3cret"),), (("authorization", "Bearer vip"),)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request([1, 2], max_tokens=2, priority=-5), metadata=user))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "priority token" in e.value.details()
        # A less important class is anyone's to take; a priority token admits and raises.
        for metadata, priority in [(user, 7), (vip, -5), (vip, 0)]:
            out = list(stub.Generate(request([1, 2], max_tokens=2, priority=priority),
                                     metadata=metadata))
            assert out[-1].finish_reason == "length", (metadata, priority)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request([1, 2], max_tokens=2, priority=-101), metadata=vip))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_default_message_limit_is_a_few_mib(server):
    with GrpcServer(server, port=0) as g, grpc.insecure_channel(g.address) as channel:
        stub = medha_pb2_grpc.MedhaStub(channel)
        with pytest.raises(grpc.RpcError) as e:      # ~6 MiB: grpc refuses it before parsing
            list(stub.Generate(request("a" * (6 << 20), max_tokens=2)))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in e.value.details(), e.value.details()


def test_message_size_and_concurrency_limits(server):
    with GrpcServer(server, port=0, max_message_bytes=1024, max_concurrent_rpcs=1) as g, \
            grpc.insecure_channel(g.address) as channel:
        stub = medha_pb2_grpc.MedhaStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request([200] * 1000)))   # 2 bytes per id: ~2 KB
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        held = stub.Generate(request(list(range(20)), max_tokens=200))
        next(held)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request([1, 2], max_tokens=2)))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        held.cancel()
    assert wait_until_idle(server)


def test_stubs_are_generated_when_missing_or_stale(tmp_path):
    """serving/proto/__init__.py, run from a fresh copy of the package (as setup.py's build
    step runs it, and as a first import does), writes the stubs beside the .proto files."""
    import importlib.util
    import os
    import pathlib
    import shutil

    import serving.proto

    proto_dir = tmp_path / "serving" / "proto"
    proto_dir.mkdir(parents=True)
    for source in pathlib.Path(serving.proto.__file__).parent.glob("*.proto"):
        shutil.copy(source, proto_dir)
    shutil.copy(serving.proto.__file__, proto_dir)

    def run():
        spec = importlib.util.spec_from_file_location("_proto_copy", proto_dir / "__init__.py")
        spec.loader.exec_module(importlib.util.module_from_spec(spec))

    run()
    stubs = sorted(p.name for p in proto_dir.glob("*_pb2*.py"))
    assert stubs == ["medha_pb2.py", "medha_pb2_grpc.py"]
    grpc_stub = (proto_dir / "medha_pb2_grpc.py").read_text()
    assert "from serving.proto import medha_pb2" in grpc_stub and "class MedhaStub" in grpc_stub
    stub = proto_dir / "medha_pb2.py"
    built = stub.stat().st_mtime_ns
    run()                             # up to date: left alone
    assert stub.stat().st_mtime_ns == built
    os.utime(proto_dir / "medha.proto", ns=(built + 10**9, built + 10**9))
    run()                             # the .proto is newer: rebuilt
    assert stub.stat().st_mtime_ns > built


# --- Identity and cancellation: any order of events frees the pages, and a client's
# request_id is a label, so reusing it never reaches another request. ------------------

class FakeContext:
    """The part of grpc.ServicerContext Generate uses; `ended` says the call is over
    before the servicer registers its callback (then grpc never calls it)."""

    def __init__(self, ended=False):
        self.ended, self.callbacks = ended, []

    def add_callback(self, callback):
        if self.ended:
            return False
        self.callbacks.append(callback)
        return True

    def end(self):                 # what grpc does when the call ends: run the callbacks
        self.ended = True
        for callback in self.callbacks:
            callback()

    def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")

    def invocation_metadata(self):
        return ()


def servicer_call(server, prompt, context, max_tokens=200, request_id=""):
    from serving.grpc_service import MedhaServicer
    return MedhaServicer(server).Generate(request(prompt, max_tokens=max_tokens,
                                                  request_id=request_id), context)


def test_a_call_that_ended_before_submit_returned_is_cancelled(server):
    responses = list(servicer_call(server, list(range(30)), FakeContext(ended=True)))
    assert responses[-1].finished and responses[-1].finish_reason == "cancelled"
    assert wait_until_idle(server)


def test_a_call_ended_during_the_stream_or_abandoned_is_cancelled(server):
    context = FakeContext()
    call = servicer_call(server, list(range(30)), context)
    assert next(call).token_ids                           # running, holding pages
    context.end()
    assert list(call)[-1].finish_reason == "cancelled"
    assert wait_until_idle(server)
    cancelled = lambda: server.metrics.registry.get_sample_value(
        "medha_requests_finished_total", {"finish_reason": "cancelled"}) or 0
    before = cancelled()
    call = servicer_call(server, list(range(30)), FakeContext())   # callback never runs
    next(call)
    call.close()                                          # the stream is dropped
    assert wait_until_idle(server)
    assert cancelled() == before + 1                      # stopped, not run to the end


def test_a_stale_callback_never_cancels_a_newer_request_reusing_the_id(server, stub):
    expected = [r.token_ids for r in stub.Generate(request(list(range(5, 25)), max_tokens=40))]
    old_context = FakeContext()
    old = list(servicer_call(server, [1, 2, 3], old_context, max_tokens=2, request_id="dup"))
    assert old[-1].finish_reason == "length"
    newer = servicer_call(server, list(range(5, 25)), FakeContext(), max_tokens=40,
                          request_id="dup")
    first = next(newer)
    old_context.end()                                     # the old call's callback, late
    assert not server.cancel("dup")                       # a label names no request
    rest = list(newer)
    assert {first.request_id} | {r.request_id for r in rest} == {"dup"}
    assert rest[-1].finish_reason == "length"
    assert [first.token_ids] + [r.token_ids for r in rest] == expected
    assert wait_until_idle(server)


def test_clients_cancelling_before_during_and_after_submit_with_reused_ids_leak_nothing(
        server, endpoint):
    import random
    import threading

    rng = random.Random(0)
    finals, lock = [], threading.Lock()

    def client(i):
        with grpc.insecure_channel(endpoint.address) as channel:
            stub = medha_pb2_grpc.MedhaStub(channel)
            call = stub.Generate(request(list(range(1 + i, 20 + i)), max_tokens=60,
                                         request_id=f"same-{i % 3}"))
            delay = rng.choice([0.0, 0.0005, 0.002, 0.01, 0.05])
            if delay:
                time.sleep(delay)
            call.cancel()                 # before the server saw it, during, or after
            try:
                for response in call:
                    if response.finished:
                        with lock:
                            finals.append(response.finish_reason)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.CANCELLED:
                    with lock:
                        finals.append(f"{e.code().name}: {e.details()}")

    # Beside them, calls under the same ids that must finish whole.
    with grpc.insecure_channel(endpoint.address) as channel:
        stub = medha_pb2_grpc.MedhaStub(channel)
        keepers = [stub.Generate(request(list(range(40, 50)), max_tokens=30,
                                         request_id=f"same-{k}")) for k in range(3)]
        threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for call in keepers:
            responses = list(call)
            assert responses[-1].finish_reason == "length"
            assert sum(len(r.token_ids) for r in responses) == 30
    assert set(finals) <= {"cancelled", "length"}
    assert wait_until_idle(server)
    assert not server.replicas[0].loop._in_flight and not server.controller.has_unfinished()


def test_session_id_reaches_the_router_and_a_lost_replica_is_unavailable(server, stub,
                                                                         monkeypatch,
                                                                         record_sessions):
    """GenerateRequest.session_id is the submit's session; a request whose replica failed
    with none to take it over ends the call with UNAVAILABLE, as does one no replica can
    take at all."""
    from medha_jax.cluster.router import NoHealthyReplica
    from serving.outputs import RequestHandle, StreamDelta

    sessions = record_sessions(server)
    final = list(stub.Generate(request([4, 5, 6], max_tokens=2, session_id="chat-3")))[-1]
    list(stub.Generate(request([4, 5, 6], max_tokens=2)))
    assert sessions == ["chat-3", None] and final.metrics.replica == 0

    def lost_mid_stream(prompt, *args, **kwargs):
        handle = RequestHandle("r", [4, 5, 6], lambda _: False)
        handle._push(StreamDelta("r", (7,), "x", finished=False))
        handle._push(StreamDelta("r", (), "", finished=True, finish_reason="error",
                                 error="unavailable: replica 1 is down", unavailable=True))
        return handle
    monkeypatch.setattr(server, "submit", lost_mid_stream)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request([4, 5, 6])))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "replica 1 is down" in e.value.details()

    def no_replica(*args, **kwargs):
        raise NoHealthyReplica("none of the 2 replicas is healthy")
    monkeypatch.setattr(server, "submit", no_replica)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request([4, 5, 6])))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
