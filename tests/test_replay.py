"""Trace replay: arrival times honoured, every request accounted for, timings sane."""

import asyncio

import pytest

from medha_jax.latency_report import summarize
from medha_jax.request import SLO
from medha_jax.workloads import SLOPolicy, TraceRequest, WorkloadSpec, generate_workload
from serving.outputs import StreamDelta
from serving.replay import replay_trace


class ScriptedServer:
    """A stand-in that streams one token per `token_delay_s`; some prompts misbehave.

    With misbehave, prompt length 13: refused at submission; 17: finishes with "error";
    19: never ends.
    """

    def __init__(self, token_delay_s=0.002, misbehave=True):
        self.token_delay_s = token_delay_s
        self.misbehave = misbehave
        self.submitted = []          # (request_id, prompt_len, slo, max_tokens)
        self.closed = []             # request ids whose stream was closed

    def generate_async(self, prompt, sampling_params, *, slo=None, priority=0, request_id=None,
                       session_id=None):
        if self.misbehave and len(prompt) == 13:
            raise ValueError("prompt: 13 tokens is unlucky")
        request_id = request_id or f"req-{len(self.submitted)}"
        self.submitted.append((request_id, len(prompt), slo, sampling_params.max_tokens))
        return self._stream(request_id, len(prompt) if self.misbehave else 0,
                            sampling_params.max_tokens)

    async def _stream(self, request_id, prompt_len, max_tokens):
        try:
            if prompt_len == 19:
                await asyncio.sleep(3600)
            for i in range(max_tokens):
                await asyncio.sleep(self.token_delay_s)
                last = i == max_tokens - 1
                reason = ("error" if prompt_len == 17 else "length") if last else None
                yield StreamDelta(request_id, (i,), "x", finished=last, finish_reason=reason,
                                  error="engine fell over" if prompt_len == 17 and last else None)
        finally:
            self.closed.append(request_id)


def test_every_request_gets_a_record_with_its_outcome():
    trace = [TraceRequest(0.00, 10, 4), TraceRequest(0.01, 13, 4), TraceRequest(0.02, 17, 3),
             TraceRequest(0.03, 19, 2), TraceRequest(0.04, 30, 5, is_long=True)]
    server = ScriptedServer()
    records = replay_trace(server, trace, vocab_size=50, progress=False,
                           prefill_time_s=lambda n: 1.0, request_timeout_s=0.5)
    # In trace order, named by the server once it streamed something, else by position.
    assert [r.request_id for r in records] == ["req-0", "trace-r000001", "req-1",
                                               "trace-r000003", "req-3"]
    ok, refused, errored, hung, long = records
    assert ok.completed and ok.output_tokens == 4 and ok.error is None
    assert 0 < ok.ttft_s <= ok.e2e_s and ok.tpot_s > 0
    assert not refused.completed and "unlucky" in refused.error and refused.ttft_s is None
    assert not errored.completed and errored.error == "engine fell over"
    assert errored.finish_reason == "error" and errored.output_tokens == 3
    assert not hung.completed and "timed out" in hung.error
    assert "req-2" in server.closed                   # the abandoned stream was closed
    assert long.completed and long.is_long and long.output_tokens == 5
    # SLOs from the policy: long requests get factor x predicted prefill.
    slos = {rid: slo for rid, _, slo, _ in server.submitted}
    assert slos["req-0"] == SLO(ttft_s=SLOPolicy().short_ttft_s, tpot_s=SLOPolicy().tpot_s)
    assert slos["req-3"].ttft_s == pytest.approx(SLOPolicy().long_ttft_factor * 1.0)
    s = summarize(records)
    assert (s["num_requests"], s["num_completed"], s["num_failed"]) == (5, 2, 3)


def test_arrivals_follow_the_trace_clock_scaled():
    trace = generate_workload(WorkloadSpec(num_requests=12, qps=40.0, long_fraction=0.0, seed=1,
                                           short_scale=0.01, output_scale=0.01))
    records = replay_trace(ScriptedServer(token_delay_s=0.0, misbehave=False), trace, vocab_size=50,
                           progress=False, time_scale=2.0)
    assert all(r.completed for r in records)
    for entry, record in zip(trace, records):
        # Never early; late only by scheduling noise (bounded loosely, no wall-clock limit).
        assert record.arrival_s >= 2.0 * entry.arrival_s - 1e-3
    assert [r.prompt_tokens for r in records] == [e.prompt_tokens for e in trace]


def test_replay_works_from_inside_a_running_event_loop():
    async def notebook_cell():
        return replay_trace(ScriptedServer(), [TraceRequest(0.0, 5, 2)], vocab_size=10,
                            progress=False)
    (record,) = asyncio.run(notebook_cell())
    assert record.completed and record.output_tokens == 2


@pytest.fixture(scope="module")
def tiny_server():
    from medha_jax import load_model
    from medha_jax.engine import EngineConfig
    from serving.server import Server

    engine = EngineConfig(page_size=16, max_kv_tokens=2048, max_model_len=256,
                          max_tokens_per_step=64, min_token_bucket=64, max_seqs=8)
    with Server(load_model("tiny"), scheduler="lars", engine_config=engine) as server:
        yield server


def _live_trace():
    return generate_workload(WorkloadSpec(
        num_requests=10, qps=20.0, long_fraction=0.2, seed=2, short_scale=0.02,
        long_scale=2e-4, output_scale=0.01, max_prompt_tokens=120, max_output_tokens=6))


def _check_nothing_lost(records, trace):
    assert [r.error for r in records] == [None] * len(trace)
    assert [r.output_tokens for r in records] == [e.output_tokens for e in trace]
    assert [r.is_long for r in records] == [e.is_long for e in trace]
    assert len({r.request_id for r in records}) == len(trace)
    for r in records:
        assert r.completed and r.finish_reason == "length"
        assert 0 < r.ttft_s <= r.e2e_s
    s = summarize(records)
    assert s["long_total"] == s["long_completed"] == 2 and s["throughput_tok_s"] > 0


def test_replay_against_a_live_server_loses_nothing(tiny_server):
    trace = _live_trace()
    prefill_time_s = tiny_server.controller.prefill_time_cache
    records = replay_trace(tiny_server, trace, vocab_size=tiny_server.config.vocab_size,
                           progress=False, prefill_time_s=prefill_time_s,
                           request_timeout_s=300)
    _check_nothing_lost(records, trace)
    # A second replay on the same server: the server names requests, so no id clashes.
    again = replay_trace(tiny_server, trace[:3], vocab_size=tiny_server.config.vocab_size,
                         progress=False, prefill_time_s=prefill_time_s,
                         request_timeout_s=300)
    assert all(r.completed for r in again)
    assert not {r.request_id for r in again} & {r.request_id for r in records}
    assert tiny_server.num_free_pages == tiny_server.num_total_pages


def test_replay_over_grpc(tiny_server):
    from serving.grpc_service import GrpcServer
    from serving.replay import GrpcTarget

    trace = _live_trace()
    with GrpcServer(tiny_server, token="s3cret") as front:
        records = replay_trace(GrpcTarget(front.address, token="s3cret"), trace,
                               vocab_size=tiny_server.config.vocab_size, progress=False,
                               prefill_time_s=tiny_server.controller.prefill_time_cache,
                               request_timeout_s=300)
        _check_nothing_lost(records, trace)
        # A wrong token: every request fails with the status, none is lost.
        short = [e for e in trace if not e.is_long][:2]
        denied = replay_trace(GrpcTarget(front.address, token="wrong"), short,
                              vocab_size=tiny_server.config.vocab_size, progress=False)
    assert [r.completed for r in denied] == [False, False]
    assert all("UNAUTHENTICATED" in r.error for r in denied)
