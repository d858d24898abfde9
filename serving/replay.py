"""Replays a request trace against a live Server, honouring arrival times.

    from serving.replay import replay_trace
    records = replay_trace(server, trace, vocab_size=server.config.vocab_size)
    print(format_table({"lars": summarize(records)}))

One asyncio task per in-flight request: a dispatcher sleeps until each request's arrival
(trace time x time_scale), submits it through `server.generate_async`, and a task streams
its output, timing it as a client sees it (time.monotonic, from just before submission):

    ttft = first delta with tokens - submit;  e2e = final delta - submit
    tpot = (final delta - first token) / max(tokens - 1, 1)

Nothing is lost: every trace entry yields one record, completed (finished by length or
stop) or failed with the error (refused at submission, finished with "error" or
"cancelled", timed out, or the stream broke).

The same replay runs against a remote `medha-jax serve` through `GrpcTarget(address)`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import AsyncIterator, Callable, Protocol, Sequence

from tqdm import tqdm

from medha_jax.latency_report import LatencyRecord, tpot
from medha_jax.request import SLO, Request
from medha_jax.sampling_params import SamplingParams
from medha_jax.workloads import SLOPolicy, TraceRequest, to_requests
from serving.outputs import StreamDelta

# Replay produces the record the latency report consumes; the name says where it came from.
ReplayRecord = LatencyRecord


class StreamingTarget(Protocol):
    """What replay needs of a server: serving.server.Server has it."""

    def generate_async(self, prompt: list[int], sampling_params: SamplingParams, *,
                       slo: SLO | None = None, priority: int = 0,
                       request_id: str | None = None,
                       session_id: str | None = None) -> AsyncIterator[StreamDelta]: ...


class GrpcTarget:
    """A StreamingTarget over gRPC: replays against `medha-jax serve` at `address`.

    The channel belongs to the event loop that first uses it (grpc.aio's rule); each
    replay_trace call runs its own loop, so use one GrpcTarget per replay.
    """

    def __init__(self, address: str, *, token: str | None = None,
                 max_message_bytes: int = 64 << 20):
        self.address = address
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._options = [("grpc.max_send_message_length", max_message_bytes),
                         ("grpc.max_receive_message_length", max_message_bytes)]
        self._stub = None

    def generate_async(self, prompt: list[int], sampling_params: SamplingParams, *,
                       slo: SLO | None = None, priority: int = 0,
                       request_id: str | None = None,
                       session_id: str | None = None) -> AsyncIterator[StreamDelta]:
        import grpc

        from serving.proto import medha_pb2, medha_pb2_grpc

        if self._stub is None:
            channel = grpc.aio.insecure_channel(self.address, options=self._options)
            self._stub = medha_pb2_grpc.MedhaStub(channel)
        p = sampling_params
        message = medha_pb2.GenerateRequest(
            token_ids=medha_pb2.TokenIds(ids=list(prompt)),
            sampling=medha_pb2.SamplingParams(
                temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                max_tokens=p.max_tokens, seed=p.seed, stop=list(p.stop),
                stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos),
            slo=None if slo is None else medha_pb2.SLO(ttft_s=slo.ttft_s, tpot_s=slo.tpot_s),
            priority=priority, request_id=request_id or "", session_id=session_id or "")
        return self._deltas(self._stub.Generate(message, metadata=self._metadata))

    @staticmethod
    async def _deltas(call) -> AsyncIterator[StreamDelta]:
        try:
            async for r in call:
                yield StreamDelta(r.request_id, tuple(r.token_ids), r.text, r.finished,
                                  r.finish_reason or None, None, r.error or None)
        finally:
            call.cancel()            # no-op once finished; cancels the request otherwise


def replay_trace(server: StreamingTarget, trace: Sequence[TraceRequest], *, vocab_size: int,
                 progress: bool = True, time_scale: float = 1.0,
                 slo_policy: SLOPolicy = SLOPolicy(),
                 prefill_time_s: Callable[[int], float] | None = None, seed: int = 0,
                 first_token_id: int = 0, request_timeout_s: float | None = None
                 ) -> list[ReplayRecord]:
    """Submits every request of `trace` at its arrival time and waits for all of them.

    Prompts are synthetic token ids in [first_token_id, vocab_size) (seeded; requests of
    one session share a prefix); SLOs follow `slo_policy` (long requests need
    prefill_time_s, see workloads.to_requests). time_scale stretches the trace's clock
    (0.5 = twice the rate). request_timeout_s cancels a request that has not finished that
    long after submission (recorded as failed). Returns one record per trace entry, in
    trace order, named by the server's request id (or "trace-<id>" if none streamed);
    arrival_s is the actual submission time after the replay started.
    """
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale!r}")
    requests = to_requests(trace, slo_policy=slo_policy, prefill_time_s=prefill_time_s,
                           vocab_size=vocab_size, seed=seed, first_token_id=first_token_id)

    def run() -> list[ReplayRecord]:
        return asyncio.run(_replay(server, trace, requests, progress=progress,
                                   time_scale=time_scale, request_timeout_s=request_timeout_s))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run()
    # Called from inside an event loop (a notebook): replay on a thread with its own loop.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result()


async def _replay(server: StreamingTarget, trace: Sequence[TraceRequest],
                  requests: Sequence[Request], *, progress: bool, time_scale: float,
                  request_timeout_s: float | None) -> list[ReplayRecord]:
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
    records: list[ReplayRecord | None] = [None] * len(trace)
    bar = tqdm(total=len(trace), desc="replay", unit="req", disable=not progress)
    start = time.monotonic()
    t0 = trace[order[0]].arrival_s if order else 0.0

    async def one(i: int) -> None:
        records[i] = await _run_one(server, trace[i], requests[i], start, request_timeout_s)
        bar.update(1)

    tasks = []
    try:
        for i in order:
            delay = start + (trace[i].arrival_s - t0) * time_scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    finally:
        bar.close()
    return records


async def _run_one(server: StreamingTarget, entry: TraceRequest, request: Request,
                   start: float, timeout_s: float | None) -> ReplayRecord:
    submitted = time.monotonic()
    first_token = finished_at = None
    num_tokens = 0
    final: StreamDelta | None = None
    error = None
    stream = None
    name = f"trace-{request.request_id}"   # until a delta brings the server's name
    try:
        async with asyncio.timeout(timeout_s):
            # The server names the request: ids stay unique across replays on one server.
            stream = server.generate_async(request.prompt_token_ids, request.sampling,
                                           slo=request.slo, session_id=request.session_id)
            async for delta in stream:
                now = time.monotonic()
                name = delta.request_id
                if delta.token_ids:
                    num_tokens += len(delta.token_ids)
                    if first_token is None:
                        first_token = now
                if delta.finished:
                    final, finished_at = delta, now
    except TimeoutError:
        error = f"timed out after {timeout_s} s"
    except Exception as e:           # refused at submission, or the stream broke
        error = f"{type(e).__name__}: {e}"
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()           # cancels the request if it is still running
    if error is None and final is None:
        error = "the stream ended without a final message"
    if error is None and final.finish_reason not in ("length", "stop"):
        error = final.error or f"finished with reason {final.finish_reason!r}"
    completed = error is None
    return ReplayRecord(
        request_id=name, arrival_s=submitted - start,
        prompt_tokens=entry.prompt_tokens, output_tokens=num_tokens, is_long=entry.is_long,
        completed=completed,
        ttft_s=None if first_token is None else first_token - submitted,
        tpot_s=(tpot(first_token, finished_at, num_tokens)
                if completed and first_token is not None else None),
        e2e_s=finished_at - submitted if completed else None,
        finish_reason=None if final is None else final.finish_reason, error=error,
        num_preemptions=(final.metrics.num_preemptions
                         if final is not None and final.metrics is not None else 0),
        num_cached_tokens=(final.metrics.num_cached_tokens
                           if final is not None and final.metrics is not None else 0),
        replica=final.metrics.replica if final is not None and final.metrics is not None else 0)
