"""Load test of the gRPC service: N concurrent streaming clients on loopback.

    python -m benchmarks.load --quick
    python -m benchmarks.load --model smollm2-135m --clients 1 8 32 --requests 200 --json load.json

Starts a Server and its GrpcServer on 127.0.0.1 (a free port), then for each client count
runs that many client threads, each sending Generate calls back to back (random prompt
token ids, seeded) until the request count or the time limit is reached. Every call ends
in exactly one of:

    completed: a final message with finish_reason "length" or "stop"
    failed:    an error status, or a final message saying "error" / "cancelled"
    lost:      the stream ended with neither (must be 0: the service never drops a call)

TTFT is the time from sending the call to the first message carrying tokens; e2e to the
final message. Latency percentiles cover completed calls.

Soak (`--soak SECONDS`): `--clients` (the largest value) concurrent streaming clients for
that long, each call drawn at random: a prompt of 8-128 tokens and 1-64 output tokens, and
one of three fates: run to the end (70%), cancelled by the client after a random number
of tokens, possibly before the first (15%), or a deadline of 20 ms-2 s (15%). Every call
ends as completed, cancelled (by the client or its deadline), failed (any other error) or
lost (no final message and no error: must be 0). At the end the server must hold no
request and every KV page must be free again (pages_free_end == pages_free_start), and
still answer its health check and a request; the exit status is 1 otherwise.

    python -m benchmarks.load --soak 600 --clients 16
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import threading
import time

import numpy as np

QUICK = dict(model="tiny", clients=[4, 32], requests=400, duration_s=30.0, prompt_tokens=64,
             max_tokens=16)


@dataclasses.dataclass
class CallRecord:
    outcome: str                 # "completed" | "failed" | "lost"
    ttft_s: float | None = None
    e2e_s: float | None = None
    num_tokens: int = 0
    detail: str = ""


def one_call(stub, medha_pb2, prompt: list[int], max_tokens: int, metadata) -> CallRecord:
    import grpc

    msg = medha_pb2.GenerateRequest(
        token_ids=medha_pb2.TokenIds(ids=prompt),
        sampling=medha_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                          ignore_eos=True))
    start = time.perf_counter()
    first = final = None
    num_tokens = 0
    try:
        for response in stub.Generate(msg, metadata=metadata):
            if response.token_ids and first is None:
                first = time.perf_counter()
            num_tokens += len(response.token_ids)
            if response.finished:
                final = response
    except grpc.RpcError as e:
        return CallRecord("failed", detail=f"{e.code().name}: {e.details()}")
    end = time.perf_counter()
    if final is None:
        return CallRecord("lost", detail="stream ended without a final message")
    if final.finish_reason not in ("length", "stop"):
        return CallRecord("failed", detail=f"{final.finish_reason}: {final.error}")
    return CallRecord("completed", ttft_s=None if first is None else first - start,
                      e2e_s=end - start, num_tokens=num_tokens)


def _run_clients(address: str, *, clients: int, seconds: float, seed: int, token: str | None,
                 call) -> tuple[list, float]:
    """`clients` threads, each on its own channel, repeat `call(stub, medha_pb2, rng,
    metadata)` until `seconds` pass or it returns None; returns the records and the wall
    time."""
    import grpc

    from serving.proto import medha_pb2, medha_pb2_grpc

    metadata = (("authorization", f"Bearer {token}"),) if token else None
    records: list = []
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def client(index: int) -> None:
        rng = np.random.default_rng([seed, index])
        with grpc.insecure_channel(address) as channel:
            stub = medha_pb2_grpc.MedhaStub(channel)
            while time.perf_counter() < deadline:
                record = call(stub, medha_pb2, rng, metadata)
                if record is None:
                    return
                with lock:
                    records.append(record)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, time.perf_counter() - start


def run_load(address: str, *, clients: int, requests: int, duration_s: float,
             prompt_tokens: int, max_tokens: int, vocab_size: int, token: str | None,
             seed: int) -> tuple[list[CallRecord], float]:
    """`clients` threads share `requests` calls (or stop at duration_s); returns records
    and the wall time."""
    issued = iter(range(requests))
    lock = threading.Lock()

    def call(stub, medha_pb2, rng, metadata):
        with lock:
            if next(issued, None) is None:
                return None
        prompt = rng.integers(0, vocab_size, prompt_tokens).tolist()
        return one_call(stub, medha_pb2, prompt, max_tokens, metadata)

    return _run_clients(address, clients=clients, seconds=duration_s, seed=seed, token=token,
                        call=call)


@dataclasses.dataclass
class SoakRecord:
    outcome: str                 # "completed" | "cancelled" | "failed" | "lost"
    fate: str                    # what the client meant: "complete" | "cancel" | "deadline"
    ttft_s: float | None = None
    tpot_s: float | None = None
    detail: str = ""


def soak_call(stub, medha_pb2, rng: np.random.Generator, vocab_size: int, metadata
              ) -> SoakRecord:
    """One randomly drawn call of the soak; never raises."""
    import grpc

    fate = str(rng.choice(["complete", "cancel", "deadline"], p=[0.7, 0.15, 0.15]))
    max_tokens = int(rng.integers(1, 65))
    prompt = rng.integers(0, vocab_size, int(rng.integers(8, 129))).tolist()
    msg = medha_pb2.GenerateRequest(
        token_ids=medha_pb2.TokenIds(ids=prompt), request_id=f"soak-{rng.integers(8)}",
        sampling=medha_pb2.SamplingParams(temperature=float(rng.choice([0.0, 1.0])),
                                          max_tokens=max_tokens, ignore_eos=True))
    timeout = float(rng.uniform(0.02, 2.0)) if fate == "deadline" else 600.0
    cancel_after = int(rng.integers(0, max_tokens + 1)) if fate == "cancel" else None
    start = time.perf_counter()
    first = final = None
    num_tokens = 0
    try:
        call = stub.Generate(msg, metadata=metadata, timeout=timeout)
        if cancel_after == 0:
            call.cancel()
        for response in call:
            if response.token_ids and first is None:
                first = time.perf_counter()
            num_tokens += len(response.token_ids)
            if response.finished:
                final = response
            elif cancel_after is not None and num_tokens >= cancel_after:
                call.cancel()
    except grpc.RpcError as e:
        code = e.code()
        if (code == grpc.StatusCode.CANCELLED and fate == "cancel") or \
                (code == grpc.StatusCode.DEADLINE_EXCEEDED and fate == "deadline"):
            return SoakRecord("cancelled", fate)
        return SoakRecord("failed", fate, detail=f"{code.name}: {e.details()}")
    end = time.perf_counter()
    if final is None:
        return SoakRecord("lost", fate, detail="stream ended without a final message")
    if final.finish_reason == "cancelled":
        return SoakRecord("cancelled", fate)
    if final.finish_reason not in ("length", "stop"):
        return SoakRecord("failed", fate, detail=f"{final.finish_reason}: {final.error}")
    tpot = (end - first) / (num_tokens - 1) if first is not None and num_tokens > 1 else None
    return SoakRecord("completed", fate, ttft_s=None if first is None else first - start,
                      tpot_s=tpot)


def run_soak(address: str, *, clients: int, seconds: float, vocab_size: int,
             token: str | None, seed: int) -> tuple[list[SoakRecord], float]:
    """`clients` threads issue random calls (see the module doc) until `seconds` pass."""
    return _run_clients(
        address, clients=clients, seconds=seconds, seed=seed, token=token,
        call=lambda stub, medha_pb2, rng, metadata: soak_call(stub, medha_pb2, rng, vocab_size,
                                                              metadata))


def summarize_soak(records: list[SoakRecord], wall_s: float) -> dict:
    def pct(values, q):
        return float(np.percentile(values, q)) if values else None

    done = [r for r in records if r.outcome == "completed"]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    return {
        "calls": len(records),
        **{k: sum(r.outcome == k for r in records)
           for k in ("completed", "cancelled", "failed", "lost")},
        "wall_s": wall_s,
        "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50), "tpot_p90_s": pct(tpot, 90), "tpot_p99_s": pct(tpot, 99),
        "failure_kinds": sorted({r.detail for r in records if r.outcome in ("failed", "lost")})[:5],
    }


SOAK_COLUMNS = ("clients", "wall_s", "calls", "completed", "cancelled", "failed", "lost",
                "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "tpot_p90_s",
                "tpot_p99_s", "pages_free_start", "pages_free_end", "requests_left",
                "healthy_after")


def wait_until_idle(server, timeout_s: float = 60.0) -> None:
    """Waits (bounded) for the last cancellations to reach the server loop."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline and (
            server.num_free_pages != server.num_total_pages or server.controller.has_unfinished()):
        time.sleep(0.05)


def healthy(endpoint, server, token: str | None) -> bool:
    """The health check says SERVING and a fresh request runs to the end."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from serving.proto import medha_pb2, medha_pb2_grpc

    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(endpoint.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10).status
        responses = list(medha_pb2_grpc.MedhaStub(channel).Generate(
            medha_pb2.GenerateRequest(token_ids=medha_pb2.TokenIds(ids=[1, 2, 3]),
                                      sampling=medha_pb2.SamplingParams(max_tokens=4)),
            metadata=metadata, timeout=60))
    return (status == health_pb2.HealthCheckResponse.SERVING
            and responses[-1].finish_reason in ("length", "stop"))


def summarize(records: list[CallRecord], wall_s: float) -> dict:
    done = [r for r in records if r.outcome == "completed"]

    def pct(values, q):
        return float(np.percentile(values, q)) if values else None

    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    e2e = [r.e2e_s for r in done]
    failures = sorted({r.detail for r in records if r.outcome != "completed"})
    return {
        "completed": len(done),
        "failed": sum(r.outcome == "failed" for r in records),
        "lost": sum(r.outcome == "lost" for r in records),
        "wall_s": wall_s,
        "req_per_s": len(done) / wall_s if wall_s > 0 else None,
        "tok_per_s": sum(r.num_tokens for r in done) / wall_s if wall_s > 0 else None,
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "e2e_p50_s": pct(e2e, 50), "e2e_p99_s": pct(e2e, 99),
        "failure_kinds": failures[:5],
    }


COLUMNS = ("clients", "completed", "failed", "lost", "req_per_s", "tok_per_s", "ttft_p50_s",
           "ttft_p99_s", "e2e_p50_s", "e2e_p99_s")


def format_rows(rows: list[dict], columns=COLUMNS) -> str:
    def cell(v):
        return "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))

    table = [list(columns)] + [[cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def context(server, args) -> dict:
    import jax
    import jaxlib

    devices = jax.devices()
    return {
        "benchmark": "load", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "backend": jax.default_backend(), "device_kind": devices[0].device_kind,
        "device_count": len(devices), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
        "model": server.config.name, "dtype": server.config.dtype,
        "mesh_shape": dict(server.model.mesh.shape), "policy": server.policy,
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
        "requests_per_config": args.requests, "duration_s_per_config": args.duration_s,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny",
                        help="preset, checkpoint dir or .gguf (default: tiny random weights)")
    parser.add_argument("--policy", default="lars-mp",
                        help="scheduling policy (default: the Server's, lars-mp)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32],
                        help="concurrent clients, one row per value")
    parser.add_argument("--requests", type=int, default=128, help="calls per configuration")
    parser.add_argument("--duration-s", type=float, default=120.0,
                        help="time limit per configuration")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--token", default=None, help="run the server with this bearer token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help=f"about a minute: {QUICK}")
    parser.add_argument("--json", default=None, help="write every figure and the context here")
    parser.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                        help="soak test for SECONDS with max(--clients) clients: random "
                             "lengths, cancellations and deadlines (see above)")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.soak is not None:
        return soak_main(args)

    from medha_jax.engine import EngineConfig
    from serving.grpc_service import GrpcServer
    from serving.server import Server

    max_clients = max(args.clients)
    engine_config = EngineConfig(max_kv_tokens=max(16_384, 2 * max_clients * (
        args.prompt_tokens + args.max_tokens)), max_model_len=args.prompt_tokens + args.max_tokens,
        max_tokens_per_step=128, max_seqs=16)
    rows = []
    with Server(args.model, scheduler=args.policy, engine_config=engine_config) as server, \
            GrpcServer(server, port=0, token=args.token,
                       max_concurrent_rpcs=max_clients + 4) as endpoint:
        print(f"serving {server.config.name} ({server.policy}) on {endpoint.address}", flush=True)
        for clients in args.clients:
            records, wall = run_load(endpoint.address, clients=clients, requests=args.requests,
                                     duration_s=args.duration_s, prompt_tokens=args.prompt_tokens,
                                     max_tokens=args.max_tokens,
                                     vocab_size=server.config.vocab_size, token=args.token,
                                     seed=args.seed)
            row = {"clients": clients, **summarize(records, wall)}
            rows.append(row)
            print(f"  {clients} clients: {row['completed']} completed, {row['failed']} failed, "
                  f"{row['lost']} lost in {wall:.1f} s", flush=True)
        info = context(server, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"context": info, "results": rows}, f, indent=2)
    print(format_rows(rows))
    return 1 if any(row["lost"] for row in rows) else 0


def soak_main(args) -> int:
    from medha_jax.engine import EngineConfig
    from serving.grpc_service import GrpcServer
    from serving.server import Server

    clients = max(args.clients)
    # Prompts up to 128 tokens and up to 64 out; a cache smaller than every client's worst
    # case, so preemption is part of the soak.
    engine_config = EngineConfig(max_kv_tokens=max(2048, clients * 96), max_model_len=192,
                                 max_tokens_per_step=128, max_seqs=16)
    with Server(args.model, scheduler=args.policy, engine_config=engine_config) as server, \
            GrpcServer(server, port=0, token=args.token,
                       max_concurrent_rpcs=clients + 4) as endpoint:
        print(f"soak: {clients} clients for {args.soak:.0f} s against {server.config.name} "
              f"({server.policy}) on {endpoint.address}", flush=True)
        free_start = server.num_free_pages
        records, wall = run_soak(endpoint.address, clients=clients, seconds=args.soak,
                                 vocab_size=server.config.vocab_size, token=args.token,
                                 seed=args.seed)
        wait_until_idle(server)
        row = {"clients": clients, **summarize_soak(records, wall),
               "pages_free_start": free_start, "pages_free_end": server.num_free_pages,
               "requests_left": len(server.controller.unfinished()),
               "healthy_after": healthy(endpoint, server, args.token)}
        info = context(server, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"context": {**info, "soak_s": args.soak}, "results": [row]}, f, indent=2)
    for kind in row["failure_kinds"]:
        print(f"  failure: {kind}")
    print(format_rows([row], SOAK_COLUMNS))
    ok = (row["lost"] == 0 and row["failed"] == 0 and row["requests_left"] == 0
          and row["pages_free_end"] == row["pages_free_start"] and row["healthy_after"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
