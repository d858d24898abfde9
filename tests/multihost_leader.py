"""Process 0 of the 2-process replica in tests/test_multihost.py (run as
`python -m tests.multihost_leader`): serves WORKLOAD on each mesh it is given, then,
when asked, a request during which the test kills process 1. With --reference it serves
the workload alone on one process instead (a mesh's one-process result). Prints one JSON
line per result, prefixed with RESULT."""

from __future__ import annotations

import argparse
import json
import os
import time

# Small enough that requests preempt one another (12 pages of 16 tokens for ~250 tokens
# wanted at once); one step shape, so warm-up is one compile per process per mesh.
ENGINE_CONFIG = dict(page_size=16, num_pages=12, max_tokens_per_step=32, min_token_bucket=32,
                     max_seqs=4, max_model_len=128)
MODEL = "tiny"


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + i * 11) % 251 + 1 for i in range(n)]


# (prompt, max_tokens): served at once, so they preempt; then a prompt sharing the first
# one's first 48 tokens, served after it, which reuses its cached pages.
CONCURRENT = [(_prompt(0, 60), 24), (_prompt(1, 50), 24), (_prompt(2, 40), 24), (_prompt(3, 5), 24)]
PREFIX_REUSE = (_prompt(0, 48) + _prompt(4, 12), 8)


def run_workload(server, decode_tokens: int | None = None) -> dict:
    """Greedy tokens of WORKLOAD on `server`, its preemptions and the reused prefix.
    decode_tokens: each CONCURRENT request's max_tokens, in place of its own (fewer: a
    model too slow for the whole of it on this CPU)."""
    from medha_jax import SamplingParams

    handles = [server.submit(p, SamplingParams(temperature=0, max_tokens=decode_tokens or n))
               for p, n in CONCURRENT]
    tokens = [list(h.result().token_ids) for h in handles]
    prompt, n = PREFIX_REUSE
    reuse = server.submit(prompt, SamplingParams(temperature=0, max_tokens=n)).result()
    scored = run_scored(server)
    allocator = server.controller.kv.allocator       # process 0's, the replica's only one
    return {"tokens": tokens + [list(reuse.token_ids)] + scored["tokens"],
            "top_ids": scored["top_ids"], "logprobs": scored["logprobs"],
            "preemptions": server.controller.num_preemptions,
            "cached_tokens": reuse.metrics.num_cached_tokens,
            "free_pages": [allocator.num_free_pages, allocator.num_pages]}


def run_scored(server) -> dict:
    """One request's greedy tokens and the model's log-softmax (of logits gathered over the
    processes' shards): each prompt token's and each sampled token's, with the 3 likeliest
    alternatives."""
    from medha_jax import SamplingParams

    scored = server.submit(_prompt(7, 20), SamplingParams(
        temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=3)).result()
    entries = (*scored.prompt_logprobs[1:], *scored.logprobs)
    return {"tokens": [list(scored.token_ids)],
            "top_ids": [[t for t, _ in e.top] for e in entries],
            "logprobs": [[e.logprob, *[lp for _, lp in e.top]] for e in entries]}


def one_process_workload(model: str, parallel: str, *, scored_only: bool = False,
                         decode_tokens: int | None = None) -> dict:
    """The workload (run_scored's request alone with scored_only) on one process with the
    mesh's devices: what the processes' replica must give."""
    from medha_jax.engine import EngineConfig
    from meshes import ParallelConfig
    from serving.server import Server

    # No warm-up: the reference compiles only the shapes its workload meets.
    with Server(model, parallel=ParallelConfig.parse(parallel), warmup=False,
                engine_config=EngineConfig(**ENGINE_CONFIG), cache_dir=False) as server:
        return run_scored(server) if scored_only else run_workload(server, decode_tokens)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference", action="store_true",
                        help="serve the workload in this one process on its own devices "
                             "(the mesh's one-process tokens) instead of as process 0")
    parser.add_argument("--coordinator")
    parser.add_argument("--channel-port", type=int)
    parser.add_argument("--parallel", action="append", required=True)
    parser.add_argument("--kill-phase", action="store_true")
    parser.add_argument("--step-timeout-s", type=float, default=20.0)
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--scored-only", action="store_true",
                        help="serve only run_scored's request (a model too slow for the "
                             "whole workload on this CPU)")
    parser.add_argument("--decode-tokens", type=int, default=None,
                        help="run_workload's decode_tokens")
    args = parser.parse_args()
    if args.reference:
        parallel, = args.parallel
        result = one_process_workload(args.model, parallel, scored_only=args.scored_only,
                                      decode_tokens=args.decode_tokens)
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.coordinator is None or args.channel_port is None:
        parser.error("--coordinator and --channel-port are needed, except with --reference")

    import jax

    from medha_jax.engine import EngineConfig
    from meshes import ParallelConfig
    from serving import multihost
    from serving.server import Server

    compiles = []
    multihost.join(0, args.num_processes, args.coordinator)
    for i, parallel in enumerate(args.parallel):
        listener = multihost.listen_socket(f"127.0.0.1:{args.channel_port}")
        engine = multihost.build_engine(args.model, ParallelConfig.parse(parallel),
                                        EngineConfig(**ENGINE_CONFIG))
        engine.mirror = multihost.StepMirror(listener, args.num_processes - 1,
                                             step_timeout_s=args.step_timeout_s)
        with Server(engine, warmup=False) as server:
            jax.monitoring.register_event_duration_secs_listener(
                lambda event, duration, **kw: compiles.append(event)
                if event == multihost.BACKEND_COMPILE_EVENT else None)
            before = len(compiles)
            result = (run_scored(server) if args.scored_only
                      else run_workload(server, args.decode_tokens))
            result.update(parallel=parallel, compiles_after_warmup=len(compiles) - before)
            print("RESULT " + json.dumps(result), flush=True)
            last = args.kill_phase and i == len(args.parallel) - 1
            if last:
                _kill_phase(server, engine)
        if not last:
            engine.mirror.close()
        else:
            break


def _kill_phase(server, engine) -> None:
    """A long request; once it has streamed a token, says KILL and waits for the test to
    kill process 1: the request must end with UNAVAILABLE within the step timeout."""
    from medha_jax import SamplingParams

    handle = server.submit(_prompt(5, 20), SamplingParams(temperature=0, max_tokens=100))
    stream = iter(handle)
    next(stream)
    print("KILL", flush=True)
    killed_at = time.monotonic()
    error = None
    try:
        for _ in stream:
            pass
        out = handle.result()
        error = out.error if hasattr(out, "error") else None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - killed_at
    try:
        server.submit(_prompt(6, 4), SamplingParams(max_tokens=1))
        refused = None
    except RuntimeError as e:
        refused = str(e)
    print("RESULT " + json.dumps({
        "error": error, "seconds_to_error": seconds, "unavailable": server.unavailable,
        "new_request_refused": refused, **_health(server)}), flush=True)
    # Process 1 is gone and process 0's device threads sit in its dead collective: exit
    # without the distributed shutdown (it would wait for process 1).
    os._exit(0)


def _health(server) -> dict:
    """What the fronts' health checks answer: gRPC's status name, HTTP's code and body."""
    import http.client

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from serving.grpc_service import GrpcServer
    from serving.http_server import HttpServer

    grpc_server = GrpcServer(server, port=0)
    try:
        with grpc.insecure_channel(grpc_server.address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10).status
    finally:
        grpc_server.stop(grace=0)
    with HttpServer(server) as front:
        conn = http.client.HTTPConnection(front.host, front.port, timeout=10)
        conn.request("GET", "/health")
        response = conn.getresponse()
        body = json.loads(response.read())
        conn.close()
    return {"grpc_health": health_pb2.HealthCheckResponse.ServingStatus.Name(status),
            "http_health": [response.status, body]}


if __name__ == "__main__":
    main()
