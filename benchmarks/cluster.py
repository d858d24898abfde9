"""Routing many replicas (seed 003): every policy on the Mooncake conversation trace.

    python -m benchmarks.cluster --quick              # about a minute on a 2-core CPU
    python -m benchmarks.cluster --json results/cluster.json

Two parts, two tables:

(a) simulated: the Mooncake conversation trace (FAST'25; its hash_ids are 512-token prefix
    blocks, so requests share exactly the prefixes the trace says) replayed through
    `--replicas` simulated replicas (Llama-3 8B, one H100 each by default, the analytical
    predictor) with real prefix caches (`simulate(..., prefix_caching=True)`), once per
    routing policy, on the same requests: prefix hit rate (cached / prompt tokens), TTFT
    p50/p90, TPOT p90, load imbalance (max / min busy seconds of the replicas) and the
    router's decision time. `trace_reuse` is the hit rate one cache that never evicts
    would give the same requests: no routing gets above it, and a replica's cache that
    cannot hold a session's pages from one turn to its next (the H100 preset's, at 8
    replicas' worth of arrivals or more) keeps every policy well under it. Arrivals are compressed `--time-scale` times so that the
    replicas are loaded (the trace's own rate is 3.4 requests/s).
(b) measured: the router's decision time at 16 replicas with 10,000 live sessions, each
    with its prefix cached on one replica (index fed by cache events): p50 / p99 of
    `Router.route` for a session's next turn, given its page hashes. Hashing the prompt
    (`prefix_page_hashes`, which the replica's allocator needs too) is reported apart.
    The events name their orphans (none: each session's pages are a chain from the root),
    as an allocator's do, so the index finds each replica's depth by bisection (lookup
    `bisect`); the last row withholds them, so the index reads every page (`walk`).
(c) live on this machine: `Server(model, replicas=2, router=policy)` in this process, a
    fresh server per policy, replaying the same slice of the trace through
    `serving.replay` (arrival times honoured, sessions passed on): the trace's sessions
    that have two or more turns (`--live-min-turns`), in order of their first turn, until
    `--live-requests` requests (the first requests of the trace are all first turns: a
    slice by time would have nothing to cache). Lengths are the trace's times `--live-scale` (prompt and
    prefix blocks alike, so sharing is kept), prompts capped at the engine's context,
    outputs at `--live-output` tokens; arrivals compressed to span `--live-seconds`.
    Prefix hit rate (and `trace_reuse`, as in (a)), TTFT p50/p90, TPOT p90 and imbalance
    (max / min of the replicas' busy seconds: the sum of their measured steps).
(d) with --kill (needs Ray; not run by default): a streaming load of `--kill-requests`
    requests (default 200, all submitted at once, each streamed by its own thread) on two
    replicas that are Ray actors; `ray.kill` of `medha-replica-1` (Ray restarts it) once a
    quarter of them have finished. Counts completed, UNAVAILABLE, lost (any other end) and
    hung (not ended within `--kill-timeout` s), the completed ones whose tokens differ from
    one in-process replica's greedy tokens, requests re-run elsewhere, seconds from the
    kill until the replica left the router and until it was back in it, and the requests
    it served of a short load after that.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import time
from collections.abc import Sequence

from benchmarks.report import environment, table

TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "traces",
                     "mooncake_conversation_trace.jsonl")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cluster", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer requests; about a minute")
    p.add_argument("--json", default=None, help="write every figure and the context here")
    p.add_argument("--trace", default=TRACE, help="Mooncake conversation trace (JSONL)")
    p.add_argument("--requests", type=int, default=None,
                   help="first N requests of the trace (default 3000; --quick 300)")
    p.add_argument("--replicas", type=int, default=16, help="simulated replicas")
    p.add_argument("--time-scale", type=float, default=8.0,
                   help="arrivals compressed this many times (load)")
    p.add_argument("--model", default="llama3-8b", help="model preset of the simulation")
    p.add_argument("--hardware", default="h100", help="hardware preset of the simulation")
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism of each replica")
    p.add_argument("--policies", default=None,
                   help="comma-separated routing policies (default: all)")
    p.add_argument("--sessions", type=int, default=10_000, help="live sessions in part (b)")
    p.add_argument("--queued", type=int, default=8,
                   help="part (b): prefills queued at each replica (the router's lars-mp "
                        "TTFT walks them)")
    p.add_argument("--live-model", default=None,
                   help="model of part (c) (default smollm2-135m; --quick: tiny)")
    p.add_argument("--live-requests", type=int, default=None,
                   help="requests of part (c) (default 80; --quick 24)")
    p.add_argument("--live-scale", type=float, default=1 / 32,
                   help="part (c): prompt lengths x this (Mooncake's p50 6.9K -> 216)")
    p.add_argument("--live-output", type=int, default=16, help="part (c): output tokens at most")
    p.add_argument("--live-min-turns", type=int, default=2,
                   help="part (c): only sessions with at least this many turns (4: the trace's "
                        "long conversations, reuse like seed 003's agentic sessions)")
    p.add_argument("--live-seconds", type=float, default=None,
                   help="part (c): arrivals compressed to span this long (default 120; "
                        "--quick 30)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip (a, b, c)")
    p.add_argument("--kill", action="store_true",
                   help="part (d): kill a Ray replica during a streaming load (needs Ray)")
    p.add_argument("--kill-requests", type=int, default=200, help="part (d): requests")
    p.add_argument("--kill-output", type=int, default=None,
                   help="part (d): greedy output tokens per request (default 48; --quick 16)")
    p.add_argument("--kill-timeout", type=float, default=600.0,
                   help="part (d): seconds after which a request that has not ended hangs")
    return p.parse_args(argv)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def simulated(args) -> list[dict]:
    from medha_jax.cluster.router import ROUTING_POLICIES
    from medha_jax.config import ParallelConfig, model_preset
    from medha_jax.simulator import simulate
    from medha_jax.workloads import load_mooncake_trace, to_requests

    limit = args.requests or (300 if args.quick else 3000)
    trace = load_mooncake_trace(args.trace, limit=limit)
    trace = [dataclasses.replace(r, arrival_s=r.arrival_s / args.time_scale) for r in trace]
    # Token ids in a small vocabulary keep the prompts' lists small (Python caches small
    # ints); ids only name prefixes here, no model reads them.
    requests = to_requests(trace, vocab_size=256)
    reuse = trace_reuse(trace)
    model = model_preset(args.model)
    policies = args.policies.split(",") if args.policies else list(ROUTING_POLICIES)
    rows = []
    for policy in policies:
        result = simulate(requests, scheduler="lars-mp", model=model,
                          parallel=ParallelConfig(tp=args.tp), hardware=args.hardware,
                          num_replicas=args.replicas, routing=policy, prefix_caching=True)
        done = result.finished
        ttft = [r.first_token_time - r.arrival_time for r in done]
        tpot = [(r.finish_time - r.first_token_time) / (len(r.output_token_ids) - 1)
                for r in done if len(r.output_token_ids) > 1]
        busy = result.busy_s
        rows.append({
            "policy": policy, "requests": len(requests), "finished": len(done),
            "hit_rate": sum(r.num_cached_tokens for r in done) / sum(r.prompt_len for r in done),
            "trace_reuse": reuse,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
            "tpot_p90_s": percentile(tpot, 90),
            "imbalance_max_over_min_busy": max(busy) / max(min(busy), 1e-9),
            **predicted_over_measured(result.predicted_ttft_s, done),
            "decision_p50_us": 1e6 * percentile(result.decision_s, 50),
            "decision_p99_us": 1e6 * percentile(result.decision_s, 99),
            "wall_s": result.wall_s})
    return rows


def predicted_over_measured(predicted_ttft_s: dict[str, float], done) -> dict[str, float]:
    """The router's predicted TTFT over the simulated one, p10/p50/p90 over the requests it
    routed, and the share of them it predicted within 2x either way: how well its TTFT
    model follows the replicas' scheduler."""
    ratios = [predicted_ttft_s[r.request_id] / (r.first_token_time - r.arrival_time)
              for r in done if r.request_id in predicted_ttft_s
              and r.first_token_time > r.arrival_time]
    if not ratios:
        return {}
    return {"ttft_predicted_over_measured_p10": percentile(ratios, 10),
            "ttft_predicted_over_measured_p50": percentile(ratios, 50),
            "ttft_predicted_over_measured_p90": percentile(ratios, 90),
            "ttft_predicted_within_2x": sum(0.5 <= x <= 2 for x in ratios) / len(ratios)}


def trace_reuse(trace) -> float:
    """The prefix hit rate one cache that never evicts would give these requests (cached /
    prompt tokens, in whole prefix blocks): the most any routing can reach on them."""
    seen, cached, total = set(), 0, 0
    for r in trace:
        blocks = 0
        while blocks < len(r.prefix_blocks) and r.prefix_blocks[blocks] in seen:
            blocks += 1
        cached += min(blocks * r.block_tokens, r.prompt_tokens)
        total += r.prompt_tokens
        seen.update(r.prefix_blocks)
    return cached / max(total, 1)


def decision_time(args, num_replicas: int = 16, page_size: int = 16) -> list[dict]:
    """Router.route on a session's next turn with `args.sessions` sessions cached."""
    from medha_jax.cluster.prefix_index import CacheEvent
    from medha_jax.cluster.router import (PREDICTED_TIME, ROUTING_POLICIES, ReplicaStatus,
                                          RouteRequest, Router, RoutingConfig)
    from medha_jax.kv_cache.allocator import prefix_page_hashes
    from medha_jax.scheduler.policies import QueuedPrefill

    rng = random.Random(0)
    num_probes = 500 if args.quick else 2000
    statuses = [ReplicaStatus(prefill_s=lambda n, cached: 0.01 + 2e-5 * (n - cached),
                              page_size=page_size, num_waiting=rng.randrange(8),
                              num_running=rng.randrange(32),
                              queued_prefills=tuple(
                                  QueuedPrefill(w, rng.uniform(-1, 5), w + rng.random(),
                                                rng.randrange(16, 4096))
                                  for w in (rng.random() for _ in range(args.queued))),
                              decode_token_s=1e-3) for _ in range(num_replicas)]
    system_prompt = [rng.randrange(32_000) for _ in range(512)]
    sessions = []
    for s in range(args.sessions):
        turn = system_prompt + [rng.randrange(32_000) for _ in range(rng.randint(500, 8000))]
        sessions.append((turn, s % num_replicas))
    rows = []
    runs = [(policy, "bisect") for policy in ROUTING_POLICIES] + [(PREDICTED_TIME, "walk")]
    for policy, lookup in runs:
        router = Router(num_replicas, lambda: statuses, RoutingConfig(policy))
        seq = [0] * num_replicas
        for tokens, replica in sessions:     # every session's prefix cached where it lives
            router.index.apply(CacheEvent(replica, seq[replica],
                                          stored=tuple(prefix_page_hashes(tokens, page_size)),
                                          orphaned=() if lookup == "bisect" else None))
            seq[replica] += 1
        hash_s, route_s = [], []
        for i in range(num_probes):
            tokens, _ = sessions[rng.randrange(len(sessions))]
            prompt = tokens + [rng.randrange(32_000) for _ in range(rng.randint(20, 400))]
            start = time.perf_counter()
            hashes = tuple(prefix_page_hashes(prompt, page_size))
            hashed = time.perf_counter()
            router.route(RouteRequest(len(prompt), hashes, f"s{i}", 100))
            route_s.append(time.perf_counter() - hashed)
            hash_s.append(hashed - start)
        rows.append({"policy": policy, "lookup": lookup, "replicas": num_replicas,
                     "sessions": args.sessions, "queued": args.queued,
                     "mean_prompt_pages": round(statistics.mean(
                         len(t) for t, _ in sessions) / page_size),
                     "route_p50_us": 1e6 * percentile(route_s, 50),
                     "route_p99_us": 1e6 * percentile(route_s, 99),
                     "hash_prompt_p50_us": 1e6 * percentile(hash_s, 50)})
    return rows


def multi_turn_slice(trace, num_requests: int, min_turns: int = 2):
    """The requests of the trace's sessions with min_turns or more turns, sessions in order
    of their first turn, until num_requests requests; arrivals shifted to start at 0."""
    import collections

    turns = collections.Counter(r.session_id for r in trace)
    chosen, taken, reserved = set(), [], 0
    for r in trace:
        if turns[r.session_id] < min_turns:
            continue
        if r.session_id not in chosen:
            if reserved + turns[r.session_id] > num_requests:
                continue
            chosen.add(r.session_id)
            reserved += turns[r.session_id]
        taken.append(r)
    t0 = taken[0].arrival_s
    return [dataclasses.replace(r, arrival_s=r.arrival_s - t0) for r in taken]


def live(args) -> list[dict]:
    """Part (c): two in-process replicas per policy on this machine."""
    from medha_jax.cluster.router import ROUTING_POLICIES
    from medha_jax.engine import EngineConfig
    from medha_jax.model import load_model
    from medha_jax.workloads import load_mooncake_trace, scale_lengths
    from serving.replay import replay_trace
    from serving.server import Server

    model_name = args.live_model or ("tiny" if args.quick else "smollm2-135m")
    num_requests = args.live_requests or (24 if args.quick else 80)
    span_s = args.live_seconds or (30.0 if args.quick else 120.0)
    engine_config = EngineConfig(max_kv_tokens=16_384, max_model_len=1024,
                                 max_tokens_per_step=256, max_seqs=16)
    trace = multi_turn_slice(load_mooncake_trace(args.trace), num_requests, args.live_min_turns)
    trace = scale_lengths(trace, short_prompt_scale=args.live_scale,
                          max_prompt_tokens=engine_config.max_model_len - args.live_output,
                          max_output_tokens=args.live_output)
    policies = args.policies.split(",") if args.policies else list(ROUTING_POLICIES)
    rows = []
    for policy in policies:
        model = load_model(model_name, verbose=False)
        with Server(model, engine_config=engine_config, replicas=2, router=policy,
                    warmup=True) as server:
            records = replay_trace(server, trace, vocab_size=server.config.vocab_size,
                                   time_scale=span_s / trace[-1].arrival_s, progress=False)
            busy = [sum(seconds for _, seconds in replica.engine.step_records)
                    for replica in server.replicas]
        done = [r for r in records if r.completed]
        ttft = [r.ttft_s for r in done]
        tpot = [r.tpot_s for r in done if r.output_tokens > 1]
        rows.append({
            "policy": policy, "model": model_name, "span_s": span_s, "requests": len(records),
            "completed": len(done),
            "hit_rate": sum(r.num_cached_tokens for r in done) / sum(r.prompt_tokens
                                                                     for r in done),
            "trace_reuse": trace_reuse(trace),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
            "tpot_p90_s": percentile(tpot, 90),
            "imbalance_max_over_min_busy": max(busy) / max(min(busy), 1e-9),
            "requests_on_replica_0": sum(r.replica == 0 for r in done)})
    return rows


def kill(args) -> list[dict]:
    """Part (d): ray.kill of medha-replica-1 during a streaming load on two Ray replicas."""
    import threading

    import ray

    from medha_jax import SamplingParams
    from medha_jax.engine import EngineConfig
    from serving.ray_cluster import ACTOR_NAME, NAMESPACE
    from serving.server import Server, TokensPrompt

    engine_config = EngineConfig(max_kv_tokens=8192, max_model_len=512,
                                 max_tokens_per_step=256, max_seqs=16)
    params = SamplingParams(temperature=0.0, max_tokens=args.kill_output or
                            (16 if args.quick else 48))
    rng = random.Random(1)
    prompts = [TokensPrompt([rng.randrange(1, 256) for _ in range(rng.randint(16, 160))])
               for _ in range(args.kill_requests)]
    with Server("tiny", engine_config=engine_config, warmup=False, cache_dir=False) as local:
        expected = [out.token_ids for out in local.generate(prompts, params)]
    if not ray.is_initialized():          # two CPUs: one per replica actor
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20,
                 namespace=NAMESPACE, log_to_driver=False)
    with Server("tiny", engine_config=engine_config, warmup=False, replicas=2, cluster="ray",
                cache_dir=False) as server:
        results: dict[int, object] = {}
        streamed: dict[int, list[int]] = {}

        def consume(i, handle):
            tokens = streamed.setdefault(i, [])
            for delta in handle:
                tokens.extend(delta.token_ids)
            results[i] = handle.result(timeout=0)

        started = time.monotonic()
        threads = [threading.Thread(target=consume, args=(i, server.submit(p, params)),
                                    daemon=True) for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        while len(results) < len(prompts) // 4 and time.monotonic() < started + args.kill_timeout:
            time.sleep(0.01)
        in_flight = len(prompts) - len(results)
        ray.kill(ray.get_actor(ACTOR_NAME.format(1), namespace=NAMESPACE), no_restart=False)
        killed_at = time.monotonic()
        while server.healthy[1] and time.monotonic() < killed_at + 60:
            time.sleep(0.01)
        left_s = time.monotonic() - killed_at
        for t in threads:
            t.join(timeout=max(started + args.kill_timeout - time.monotonic(), 0.0))
        hung = sum(t.is_alive() for t in threads)
        done = [i for i, out in results.items() if out.finish_reason == "length"]
        unavailable = [i for i, out in results.items() if out.finish_reason == "error"
                       and out.error.startswith("UNAVAILABLE")]
        while (server.restarts_seen[1] == 0 or not server.healthy[1]) and \
                time.monotonic() < killed_at + args.kill_timeout:
            time.sleep(0.1)
        back_s = time.monotonic() - killed_at if server.healthy[1] else float("nan")
        after = server.generate(prompts[:8], params)
        return [{"requests": len(prompts), "in_flight_at_kill": in_flight,
                 "completed": len(done), "unavailable": len(unavailable),
                 "lost": len(results) - len(done) - len(unavailable), "hung": hung,
                 "tokens_differ": sum(results[i].token_ids != expected[i]
                                      or tuple(streamed[i]) != expected[i] for i in done),
                 "reruns": server.reruns, "left_router_s": left_s, "back_in_router_s": back_s,
                 "served_by_it_after": sum(o.metrics.replica == 1 for o in after),
                 "output_tokens": params.max_tokens}]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    skip = set(args.skip.split(",")) - {""}
    # Part (c) needs two devices; on a CPU, virtual ones, set before JAX starts.
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=2").strip()
    sim = decisions = lives = kills = []
    if "a" not in skip:
        sim = simulated(args)
        table(f"(a) simulated: Mooncake conversation trace, {args.replicas} replicas of "
              f"{args.model} (tp={args.tp}, {args.hardware} preset, AnalyticalPredictor), "
              f"arrivals x{args.time_scale}, lars-mp, real prefix caches", sim)
    if "b" not in skip:
        decisions = decision_time(args)
        table(f"(b) measured: router decision time, 16 replicas, {args.sessions} sessions "
              "cached (this CPU, Python)", decisions)
    if "c" not in skip:
        lives = live(args)
        table(f"(c) live: 2 replicas in this process ({lives[0]['model']}, lars-mp), the "
              f"trace's multi-turn sessions, lengths x{args.live_scale:.4g}, arrivals over "
              f"{lives[0]['span_s']:.0f} s", lives)
    if args.kill:
        kills = kill(args)
        table("(d) ray.kill of medha-replica-1 during a streaming load: 2 Ray replicas (tiny, "
              "greedy), all requests submitted at once, killed when a quarter had finished",
              kills)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        context = {**environment(), "model_simulated": args.model, "hardware": args.hardware,
                   "replicas": args.replicas, "time_scale": args.time_scale,
                   "trace": os.path.basename(args.trace)}
        with open(args.json, "w") as f:
            json.dump({"context": context, "simulated": sim, "decision_time": decisions,
                       "live": lives, "kill": kills}, f, indent=2)


if __name__ == "__main__":
    main()
