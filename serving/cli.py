"""The `medha-jax` command: generate, serve, demo.

    medha-jax generate "What is the capital of France?" --max-tokens 32
    medha-jax serve --port 50051 --token "$MEDHA_TOKEN" --metrics-port 9100
    medha-jax serve --http-port 8000 --no-grpc      # OpenAI API at http://127.0.0.1:8000/v1
    medha-jax serve --replicas 2 --router predicted-time   # 2 replicas, one per device group
    medha-jax serve --dp 8 --switching load    # DP <-> TP switching over 8 devices
    medha-jax serve --hosts 2 --parallel tp=8  # one replica over 2 processes (4 CPU devices each)
    medha-jax serve --hosts 2 --ray HEAD:6379  # the same, one process per Ray node
    medha-jax demo
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time

DEFAULT_PORT = 50051


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m",
                        help="preset name, Hugging Face checkpoint directory or .gguf file "
                             "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="weights and KV-cache dtype (default float32)")
    parser.add_argument("--parallel", default="",
                        help="mesh degrees, e.g. 'tp=2' (default: one device); with "
                             "--replicas, one per replica split by '/', e.g. 'tp=2/tp=1' "
                             "(a prefill replica at tp=2, a decode replica at tp=1)")
    parser.add_argument("--policy", default="lars-mp",
                        help="scheduling policy: lars-mp (default: the full Medha scheduler), "
                             "lars, lrs, edf, fcfs, fcfs-np, sarathi-512, sarathi-2048")
    parser.add_argument("--target-batch-time", type=float, default=None, metavar="SECONDS",
                        help="the batch-time budget a step's prefill chunks are sized to while "
                             "a request has a TPOT objective (default: the default SLO's "
                             "TPOT on a CPU; elsewhere 50 ms, or 8x the predicted one-token "
                             "step where that is longer, capped by the default SLO's TPOT)")
    parser.add_argument("--prefill-hold", type=float, default=None, metavar="SECONDS",
                        help="keep a newly arrived prompt's prefill out of steps that carry "
                             "decodes for up to this long (they stream at their own rate "
                             "meanwhile; with no decode running it starts at once); default 0: "
                             "co-scheduled at once")
    parser.add_argument("--cache-dir", default=None,
                        help="where compiled executables and fitted predictors are kept "
                             "between runs (default: $MEDHA_CACHE_DIR, else "
                             "~/.cache/medha-jax)")
    parser.add_argument("--no-cache", action="store_true",
                        help="neither read nor write that cache")
    engine = parser.add_argument_group("engine (defaults: EngineConfig's)")
    for flag, help in [("--max-kv-tokens", "KV-cache capacity in tokens"),
                       ("--max-model-len", "longest prompt + output, in tokens"),
                       ("--max-tokens-per-step", "tokens in one step (largest shape bucket)"),
                       ("--max-seqs", "sequences in one step"),
                       ("--min-token-bucket", "tokens in the smallest step shape (default 1: a "
                        "lone decode runs a step of one token; 16 compiles fewer shapes)")]:
        engine.add_argument(flag, type=int, default=None, help=help)


def _add_ray_args(parser: argparse.ArgumentParser) -> None:
    ray = parser.add_argument_group("replicas on Ray (the [cluster] extra)")
    ray.add_argument("--ray", nargs="?", const="ray", default=None, metavar="ADDRESS",
                     help="run each replica in a Ray actor (medha-replica-{i}, namespace "
                          "medha): join the cluster at ADDRESS (host:port or ray://...), or "
                          "$RAY_ADDRESS, else start a local one; prints 'ray address: ...'; "
                          "--replicas actors")
    ray.add_argument("--cpu-bind", default=None, metavar="CPUS",
                     help="with --ray on CPU hosts: the CPUs each replica actor runs on, "
                          "'auto' (this host's CPUs split among the replicas) or one list "
                          "per replica, '0-3|4-7' (unbound, every actor's XLA threads span "
                          "every core and the replicas' steps contend)")


ENGINE_FLAGS = ("max_kv_tokens", "max_model_len", "max_tokens_per_step", "max_seqs",
                "min_token_bucket")
LIMIT_FLAGS = ("min_ttft_s", "max_ttft_s", "min_tpot_s", "max_tpot_s", "min_priority",
               "max_priority")


def _make_server(args, *, warmup: bool, calibrate: bool, engine=None):
    """calibrate=False plans with the analytical predictor instead of timing a sweep of
    steps: enough for one request, whose schedule is the same whatever the timings.
    engine: one already built and warmed up (process 0 of a --hosts N replica)."""
    from medha_jax.cluster.router import PREDICTED_TIME, RoutingConfig
    from medha_jax.config import ParallelConfig
    from medha_jax.engine import EngineConfig
    from medha_jax.model import load_model
    from medha_jax.scheduler.config import SchedulerConfig
    from medha_jax.scheduler.predictor import AnalyticalPredictor
    from serving.server import Server
    from serving.validation import RequestLimits

    # A bad policy name or budget fails before the model loads.
    scheduler = SchedulerConfig(args.policy,
                                target_batch_time_s=getattr(args, "target_batch_time", None),
                                prefill_hold_s=getattr(args, "prefill_hold", None) or 0.0)
    replicas = getattr(args, "replicas", 1)
    router = RoutingConfig(getattr(args, "router", PREDICTED_TIME),
                           decode_delay_weight=getattr(args, "decode_delay_weight", 0.0),
                           ttft_floor=getattr(args, "ttft_floor", False))
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    if getattr(args, "roles", None) is not None:       # named before the model loads
        from serving.kv_transfer import parse_roles
        parse_roles(args.roles, replicas)
    if getattr(args, "offload", None) is not None:
        from medha_jax.cluster.offload import OffloadConfig
        if OffloadConfig.parse(args.offload).move_decodes and getattr(args, "ray", None) is None:
            raise ValueError(f"--offload {args.offload}: running decodes move between Ray "
                             f"replica actors only (add --ray)")
    per_replica = [ParallelConfig.parse(part) for part in args.parallel.split("/")]
    if len(per_replica) > 1 and len(per_replica) != replicas:
        raise ValueError(f"--parallel names {len(per_replica)} replica meshes but "
                         f"--replicas is {replicas}")
    if len(per_replica) > 1 and getattr(args, "ray", None) is not None:
        raise ValueError("--parallel with one mesh per replica is not supported with --ray "
                         "yet: every Ray replica runs the same mesh")
    cpu_bind = getattr(args, "cpu_bind", None)
    if cpu_bind is not None:
        if getattr(args, "ray", None) is None:
            raise ValueError("--cpu-bind binds Ray replica actors (--ray): replicas in one "
                             "process share its CPUs")
        from serving.ray_cluster import parse_cpu_binding
        parse_cpu_binding(cpu_bind, replicas)                  # checked before loading
    parallel = per_replica[0]
    sizes = {f: getattr(args, f) for f in ENGINE_FLAGS if getattr(args, f) is not None}
    limits = {f: getattr(args, f) for f in LIMIT_FLAGS if getattr(args, f, None) is not None}
    switching, dp = getattr(args, "switching", None), getattr(args, "dp", 1)
    pool = None
    if getattr(args, "prefill_pool", None) is not None:
        from serving.prefill_pool import PrefillPoolConfig
        if getattr(args, "ray", None) is not None or switching is not None:
            raise ValueError("--prefill-pool does not combine with --ray or --switching yet")
        pool = PrefillPoolConfig(devices=args.prefill_pool,          # checked before loading
                                 min_prompt_tokens=args.prefill_pool_min_tokens,
                                 improvement_rate=args.prefill_pool_improvement_rate)
    if (dp != 1) != (switching is not None):
        raise ValueError("--dp N and --switching POLICY go together: N base replicas (one "
                         "device each, or --parallel tp=b) that switch between DP and TP "
                         "(routed replicas of any mesh: --replicas)")
    if engine is not None:
        return Server(engine, scheduler=scheduler, limits=RequestLimits(**limits),
                      metrics_port=getattr(args, "metrics_port", None), warmup=False,
                      cache_dir=False if args.no_cache else args.cache_dir)
    if switching is not None:
        from serving.switching import SwitchingConfig
        SwitchingConfig(switching)                       # a bad name fails before loading
        return Server(args.model, parallel=dataclasses.replace(parallel, dp=dp),
                      switching=switching, dtype=args.dtype, scheduler=scheduler,
                      engine_config=EngineConfig(**sizes), limits=RequestLimits(**limits),
                      metrics_port=getattr(args, "metrics_port", None), warmup=warmup,
                      cache_dir=False if args.no_cache else args.cache_dir)
    disagg = {k: v for k in ("roles", "offload") if (v := getattr(args, k, None)) is not None}
    if pool is not None:
        disagg["prefill_pool"] = pool
    if getattr(args, "ray", None) is not None:
        # The replica actors load the model themselves, on whichever hosts Ray places them.
        return Server(args.model, parallel=parallel, dtype=args.dtype, scheduler=scheduler,
                      engine_config=EngineConfig(**sizes), limits=RequestLimits(**limits),
                      metrics_port=getattr(args, "metrics_port", None), warmup=warmup,
                      cache_dir=False if args.no_cache else args.cache_dir,
                      replicas=replicas, router=router, cluster=args.ray,
                      cpu_binding=cpu_bind, **disagg)
    model = load_model(args.model, parallel=parallel, dtype=args.dtype)
    if len(per_replica) > 1:       # each replica's own predictor, from its own mesh
        disagg["parallel"] = per_replica
    return Server(model, scheduler=scheduler, engine_config=EngineConfig(**sizes),
                  limits=RequestLimits(**limits), replicas=replicas, router=router, **disagg,
                  metrics_port=getattr(args, "metrics_port", None), warmup=warmup,
                  cache_dir=False if args.no_cache else args.cache_dir,
                  predictor=None if calibrate or len(per_replica) > 1
                  else AnalyticalPredictor(model.config, parallel))


def _generate(args) -> int:
    from medha_jax.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, stop=tuple(args.stop))
    # One request needs only the shapes it touches: compile those lazily, not the ladder.
    with _make_server(args, warmup=False, calibrate=False) as server:
        prompt = args.prompt
        if not args.raw and server.tokenizer is not None and server.tokenizer.chat_template:
            prompt = server.chat_prompt([{"role": "user", "content": prompt}])
        final = None
        for delta in server.generate_stream(prompt, params):
            print(delta.text, end="", flush=True)
            final = delta
        print()
        m = final.metrics
        print(f"[{m.num_output_tokens} tokens, finish_reason={final.finish_reason}, "
              f"ttft={m.ttft:.3f} s, tpot={m.tpot * 1e3:.1f} ms]", file=sys.stderr)
        if final.finish_reason == "error":
            print(f"error: {final.error}", file=sys.stderr)
            return 1
    return 0


def _multihost_engine(args):
    """This process's engine of a `--hosts N` replica, the job joined from the environment
    (meshes.initialize_distributed); None on a follower process, once process 0 stopped
    it (a follower serves only process 0's steps: serving.multihost)."""
    import jax

    from medha_jax.config import ParallelConfig
    from medha_jax.engine import EngineConfig
    from meshes import initialize_distributed
    from serving import multihost

    for flag in ("ray", "switching", "roles", "offload"):
        if getattr(args, flag, None) is not None:
            raise ValueError(f"--hosts does not combine with --{flag} yet")
    if args.replicas != 1:
        raise ValueError("--hosts N serves one replica over N processes: --replicas must be 1")
    initialize_distributed(heartbeat_timeout_s=10, init_timeout_s=120)
    if jax.process_count() != args.hosts:
        raise ValueError(f"--hosts {args.hosts} but the job has {jax.process_count()} processes")
    parallel = (ParallelConfig.parse(args.parallel) if args.parallel.strip()
                else ParallelConfig(tp=jax.device_count()))
    sizes = {f: getattr(args, f) for f in ENGINE_FLAGS if getattr(args, f) is not None}
    engine = multihost.build_engine(args.model, parallel, EngineConfig(**sizes),
                                    dtype=args.dtype)
    channel = multihost.channel_address()
    if jax.process_index() > 0:
        sock = multihost.connect(channel, jax.process_index())
        report = multihost.follow(engine, sock)
        print(f"process {jax.process_index()}: stopped after {report.steps} steps "
              f"({report.compiles} compiles while serving)", flush=True)
        multihost.leave(sock)
        return None
    engine.mirror = multihost.StepMirror(multihost.listen_socket(channel), args.hosts - 1,
        step_timeout_s=args.step_timeout_s)
    return engine


def _serve(args) -> int:
    if args.no_grpc and args.http_port is None:
        raise ValueError("--no-grpc needs --http-port: nothing would be served")
    token = args.token or os.environ.get("MEDHA_TOKEN") or None
    engine = None
    if args.hosts > 1:
        from meshes import cluster_detected
        from serving import multihost

        if args.ray is not None:      # Ray starts the N processes, one per host
            from serving.ray_hosts import launch_ray, without_ray_flag

            return launch_ray(args.hosts, ["-m", "serving.cli", *without_ray_flag(args.argv)],
                              cluster=args.ray, devices_per_process=args.devices_per_host,
                              max_restarts=args.max_restarts,
                              host_resources=args.ray_host_resources)
        if not cluster_detected():    # on this machine: start the N processes, then wait
            return multihost.launch_local(args.hosts, ["-m", "serving.cli", *args.argv],
                                          devices_per_process=args.devices_per_host,
                                          max_restarts=args.max_restarts)
        engine = _multihost_engine(args)
        if engine is None:
            return 0
    try:
        return _serve_fronts(args, token, engine)
    finally:
        if engine is not None:
            engine.mirror.close()          # stops the followers


def _serve_fronts(args, token, engine) -> int:
    from serving.grpc_service import GrpcServer
    from serving.http_server import HttpServer

    with _make_server(args, warmup=True, calibrate=True, engine=engine) as server:
        if getattr(server, "ray_address", None):
            print(f"ray address: {server.ray_address}", flush=True)
        frontends, addresses = [], []
        if not args.no_grpc:
            limits = ({"max_message_bytes": args.max_message_bytes}
                      if args.max_message_bytes is not None else {})
            grpc_server = GrpcServer(server, host=args.host, port=args.port, token=token,
                                     max_concurrent_rpcs=args.max_concurrent_rpcs,
                                     priority_tokens=tuple(args.priority_token), **limits)
            frontends.append(lambda: grpc_server.stop(grace=args.grace))
            addresses.append(grpc_server.address)
        if args.http_port is not None:
            http_server = HttpServer(server, host=args.host, port=args.http_port, token=token,
                                     max_concurrent_requests=args.max_concurrent_requests,
                                     model_name=args.served_model_name or args.model,
                                     priority_tokens=tuple(args.priority_token),
                                     max_connections=args.max_connections)
            frontends.append(lambda: http_server.stop(timeout=args.grace + 5))
            addresses.append(f"{http_server.url} (OpenAI API: {http_server.url}/v1)")
        routed = (f", {len(server.replicas)} replicas routed by {server.router.config.policy}"
                  if server.router is not None else "")
        if getattr(server, "switching", None) is not None:     # RayServer has none
            routed = (f", {len(server.switching.replicas)} base replicas switching "
                      f"DP <-> TP by {server.switching.config.policy}")
        print(f"serving {server.config.name} ({server.policy}{routed}) on {' and '.join(addresses)}"
              + (" (bearer token required)" if token else "")
              + (f"; metrics on http://127.0.0.1:{server.metrics_port}/metrics"
                 if server.metrics_port is not None else ""), flush=True)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        # Timed waits: Python runs a signal's handler only in the main thread, between
        # bytecodes; a SIGTERM taken by another thread (XLA's, gloo's, gRPC's) left the
        # main thread asleep in an untimed wait (seen once with --hosts 2: process 0 never
        # stopped).
        lost_at = None
        while not stop.wait(0.5):
            if engine is None or engine.mirror is None:
                continue
            # A multi-host replica that lost a process never steps again (its device
            # threads sit in the dead collective): once the fronts have said so for
            # --lost-exit-s (requests failed UNAVAILABLE, health NOT_SERVING, so a router
            # routes away), process 0 exits REPLICA_LOST for whoever restarts the replica
            # as new processes (launch_local here; SLURM, a pod controller on a cluster).
            if lost_at is None and server.unavailable is not None:
                lost_at = time.monotonic()
                print(f"replica lost: {server.unavailable}; exiting in {args.lost_exit_s:g} s "
                      f"to be restarted", flush=True)
            if lost_at is not None and time.monotonic() - lost_at >= args.lost_exit_s:
                break
        print("stopping: finishing open calls", flush=True)
        for stop_frontend in frontends:
            stop_frontend()
        if lost_at is not None:
            from serving.multihost import REPLICA_LOST_EXIT_CODE

            # Not through Server.close and the interpreter's exit: this process's step
            # still sits in the dead collective, and freeing the buffers it holds, or
            # JAX's shutdown of the job, would wait on it forever.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(REPLICA_LOST_EXIT_CODE)
    return 0


def _demo(args) -> int:
    from serving import demo

    return demo.main(quick=args.quick)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="medha-jax", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true",
                     help="send the prompt as is, without the model's chat template")
    _add_model_args(gen)
    gen.set_defaults(run=_generate)

    serve = commands.add_parser(
        "serve", help="serve the gRPC API (medha.v1.Medha + health) and/or the OpenAI HTTP API")
    serve.add_argument("--host", default="127.0.0.1",
                       help="bind address (default 127.0.0.1; 0.0.0.0 exposes it to the network "
                            "in clear text, tokens included: put a TLS proxy in front)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help="gRPC port (0: any free)")
    serve.add_argument("--http-port", type=int, default=None,
                       help="also serve the OpenAI-compatible HTTP API (/v1/completions, "
                            "/v1/chat/completions, /v1/models, /health, /metrics) on this port")
    serve.add_argument("--no-grpc", action="store_true",
                       help="serve only the HTTP API (needs --http-port)")
    serve.add_argument("--served-model-name", default=None,
                       help="the model's id in the HTTP API (default: --model's value)")
    serve.add_argument("--max-concurrent-requests", type=int, default=256,
                       help="open HTTP requests at most; more get 429")
    serve.add_argument("--token", default=None,
                       help="require 'authorization: Bearer TOKEN' (default: $MEDHA_TOKEN if set)")
    serve.add_argument("--priority-token", action="append", default=[],
                       help="a bearer token whose clients may ask for a priority more "
                            "important than the default (lower than 0); it also admits them "
                            "(repeatable). Without one no client may raise its priority")
    limits = serve.add_argument_group(
        "request limits (requests outside them are refused: INVALID_ARGUMENT / 400)")
    for flag, default, help in [
            ("--min-ttft-s", 0.1, "shortest time-to-first-token SLO a request may ask"),
            ("--max-ttft-s", 3600.0, "longest time-to-first-token SLO"),
            ("--min-tpot-s", 0.02, "shortest time-per-output-token SLO (one such decode "
                                   "would bound the time of every batch it rides in)"),
            ("--max-tpot-s", 60.0, "longest time-per-output-token SLO")]:
        limits.add_argument(flag, type=float, default=None, help=f"{help} (default {default})")
    limits.add_argument("--min-priority", type=int, default=None,
                        help="most important priority class (default -100)")
    limits.add_argument("--max-priority", type=int, default=None,
                        help="least important priority class (default 100)")
    serve.add_argument("--max-connections", type=int, default=1024,
                       help="open HTTP connections at most; past it new requests get 503")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus metrics over HTTP on this port")
    serve.add_argument("--max-concurrent-rpcs", type=int, default=64,
                       help="open calls at most; more are refused with RESOURCE_EXHAUSTED")
    serve.add_argument("--max-message-bytes", type=int, default=None,
                       help="largest request or response message (default 4 MiB)")
    serve.add_argument("--replicas", type=int, default=1,
                       help="replicas of the model in this process, each on its own group of "
                            "devices (--parallel's size; in device order) with its own KV "
                            "cache and scheduler (default 1)")
    serve.add_argument("--router", default="predicted-time",
                       help="how a request picks a replica: predicted-time (default: the "
                            "least predicted time to first token, cache- and "
                            "session-aware), round-robin, least-load, sglang-cache-aware")
    serve.add_argument("--decode-delay-weight", type=float, default=0.0,
                       help="predicted-time also charges each replica this weight x its "
                            "decodes x the prefill's seconds there: long prefills keep off "
                            "the replica whose decodes they would slow (default 0; with "
                            "--offload time+move and --ttft-floor, 1 is what beat co-located "
                            "decoding in benchmarks.disagg (g))")
    serve.add_argument("--ttft-floor", action="store_true",
                       help="predicted-time charges each replica at least the request's "
                            "predicted TTFT there (its wait behind late long prefills)")
    serve.add_argument("--roles", default=None,
                       help="what each replica does, counts in replica order: e.g. "
                            "prefill:1,decode:1 (roles mixed, prefill, decode; default all "
                            "mixed). A request prefilled on one replica decodes on another, "
                            "its KV streamed there chunk by chunk")
    serve.add_argument("--offload", default=None,
                       help="when a mixed replica hands a request's decode to another: time "
                            "(predicted seconds), never, always-heavy, cached-fraction, dynamo; "
                            "+move after it (time+move, with --ray): a running decode also "
                            "moves when a prefill queued beside it would slow it more than "
                            "moving its KV costs")
    serve.add_argument("--dp", type=int, default=1,
                       help="with --switching: this many base replicas (DP; one device each, "
                            "or TP-b with --parallel tp=b) that bind into TP groups of 2, 4, "
                            "8 of them and release")
    serve.add_argument("--switching", default=None,
                       choices=("load", "priority", "memory", "off"),
                       help="DP <-> TP switching policy (seed 004): load (TP when the host "
                            "is nearly idle, DP in bursts), priority (a request with "
                            "priority <= -1 binds a TP group at once, pausing the members' "
                            "DP requests), memory (a request longer than one replica holds "
                            "binds the smallest group that holds it), off (DP only)")
    serve.add_argument("--prefill-pool", type=int, default=None, metavar="DEVICES",
                       help="a CDSP prefill pool (seed 001, Tetris) on this many devices after "
                            "the replicas' (a power of two): prompts with a full KV page are "
                            "prefilled there, on chunks over nested device groups, and "
                            "decoded on the replicas (serving.prefill_pool)")
    serve.add_argument("--prefill-pool-min-tokens", type=int, default=0,
                       help="with --prefill-pool: shorter prompts skip the pool (default 0)")
    serve.add_argument("--prefill-pool-improvement-rate", type=float, default=None,
                       metavar="R", help="with --prefill-pool: the planner takes a larger "
                            "group only if it cuts the TTFT by more than R (0 <= R < 1; "
                            "default: looked up for the arrival rate, as in Tetris)")
    hosts = serve.add_argument_group("one replica over several processes (serving.multihost)")
    hosts.add_argument("--hosts", type=int, default=1,
                       help="processes the replica spans, one per host: every process runs "
                            "this same command (the job from $MEDHA_COORDINATOR, "
                            "$MEDHA_NUM_PROCESSES, $MEDHA_PROCESS_ID, or a TPU pod / SLURM "
                            "environment); process 0 serves the fronts. With no job in the "
                            "environment, starts the N processes on this machine")
    hosts.add_argument("--devices-per-host", type=int, default=4,
                       help="with --hosts on this machine (or on CPU-only Ray nodes): "
                            "virtual CPU devices per process")
    hosts.add_argument("--ray-host-resources", type=json.loads, default=None,
                       metavar="JSON",
                       help='with --hosts N --ray: what each host\'s Ray bundle reserves, '
                            'e.g. \'{"TPU": 4}\' or \'{"GPU": 8}\' (default {"CPU": 1}); '
                            "one bundle per node (STRICT_SPREAD), all on it on a one-node "
                            "cluster")
    hosts.add_argument("--step-timeout-s", type=float, default=60.0,
                       help="longest wait for a step on any process before the replica is "
                            "reported unavailable")
    hosts.add_argument("--lost-exit-s", type=float, default=5.0,
                       help="once the replica lost a process: seconds process 0 keeps "
                            "answering UNAVAILABLE (health NOT_SERVING) before it exits with "
                            "code 75 for the replica to be restarted")
    hosts.add_argument("--max-restarts", type=int, default=3,
                       help="with --hosts on this machine or --ray: times a lost replica is "
                            "started again as new processes (0: never)")
    serve.add_argument("--grace", type=float, default=5.0,
                       help="seconds open calls get to finish on shutdown")
    _add_model_args(serve)
    _add_ray_args(serve)
    serve.set_defaults(run=_serve)

    demo = commands.add_parser("demo", help="the convoy effect and its cure, on the CPU")
    demo.add_argument("--quick", action="store_true", help="a smaller workload")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv        # what --hosts N runs again in each process it starts
    try:
        return args.run(args)
    except ValueError as e:          # bad arguments: the message names the value
        print(f"medha-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
