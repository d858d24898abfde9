"""The convoy experiment (seed 000: figure 1, sections 6.1-6.4): short requests stuck
behind long prefills, per scheduling policy.

ShareGPT4-like short requests mixed with a fraction of Medha-SWE-like long ones
(medha_jax.workloads), Poisson arrivals at each QPS of a sweep, run under each policy;
reports short-request TTFT percentiles, long-request TTFT and completions, TPOT and
throughput, side by side on the same trace.

    python -m benchmarks.convoy --simulate --model llama3-8b --hardware a100 --gpus 16 \\
        --parallel tp=8,spp=2 --qps 0.75 --out results/convoy --json results/convoy.json
    python -m benchmarks.convoy --server        # live on the CPU: lars-mp, lars, fcfs-np
    python -m benchmarks.convoy --validate-simulator                   # simulator vs engine
    python -m benchmarks.convoy --simulate --figure13 --out results/figure13

--simulate runs the discrete-event simulator (medha_jax.simulator) over the analytical
predictor of a hardware preset; every figure it prints is simulated (--quick: 300
requests, 3 policies, well under a minute). --server replays the trace (lengths scaled
down to fit a CPU: SERVER_SCALES, --long-scale, --max-model-len) against a live Server
per policy, all over one engine compiled and calibrated once (that start-up takes about
5 minutes on 2 cores, --quick or not; the default run about 20 in all).
--validate-simulator runs each policy live and simulates the same trace with the server's
scheduler and predictor, comparing TTFT/TPOT percentiles (within 25% passes): once with
the simulated device as fast as calibration.fit_predictor(engine) predicts, and once as fast as the
steps measured in the run (a shared CPU's step times change with its load; the second
separates the simulator's own error from that drift, and is the one the bar applies to).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Sequence

from benchmarks.report import environment
from medha_jax.config import ParallelConfig, model_preset
from medha_jax.latency_report import (LatencyRecord, format_table, records_from_requests,
                                      summarize)
from medha_jax.request import SLO
from medha_jax.workloads import (SLOPolicy, TraceRequest, WorkloadSpec, fit_lengths,
                                 generate_workload, load_azure_trace, request_id, to_requests)

ALL_POLICIES = ("fcfs-np", "sarathi-512", "sarathi-2048", "fcfs", "edf", "lrs", "lars",
                "lars-mp")
# Figure 13 of seed 000: the policy ablation (every other Medha mechanism kept), and the
# loads, as multiples of the QPS at which long prefills alone fill every replica.
FIGURE13_POLICIES = ("fcfs", "edf", "lrs", "lars", "lars-mp")
FIGURE13_LOADS = (0.5, 0.9, 1.3)

# Scaled lengths for the live CPU server: short prompts of tens to hundreds of tokens
# (p50 86), long ones of thousands (p50 ~3.9K, p90 at the 8K context), outputs of tens
# (ShareGPT4 and Medha-SWE shapes kept), within the engine below. Long prompts are
# scaled 5x less than short ones: a long prefill must take many times a burst of short
# ones for the convoy to show (the paper's ratio of p50s is 227, here 45); at half this
# long_scale, prompts of at most 4K tokens, a long prefill took ~6 s on 2 cores, no more
# than a few short requests arriving together, and fcfs-np's p99 stayed ~3x lars-mp's.
SERVER_SCALES = dict(short_scale=0.05, long_scale=0.01, output_scale=0.04,
                     max_output_tokens=64)
# A CPU-sized engine: few buckets keep warm-up and calibration to minutes on 2 cores; the
# cache holds four prompts of the whole context. Prefix caching off: every policy replays
# the same prompts, and a later one must not find an earlier one's pages in the cache.
SERVER_ENGINE = dict(page_size=16, max_kv_tokens=32_768, max_model_len=8192,
                     max_tokens_per_step=256, min_token_bucket=32, max_seqs=16,
                     enable_prefix_caching=False)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.convoy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--simulate", action="store_true",
                      help="simulate a cluster (the default mode)")
    mode.add_argument("--server", action="store_true",
                      help="replay against a live Server per policy (CPU-sized lengths)")
    mode.add_argument("--validate-simulator", action="store_true",
                      help="live run per policy plus simulations of the same trace "
                           "(steps as calibrated and as run); compares TTFT/TPOT "
                           "percentiles")
    p.add_argument("--figure13", action="store_true",
                   help="simulate: seed 000's figure 13 - TTFT / deadline CDFs of "
                        f"{', '.join(FIGURE13_POLICIES)} at {FIGURE13_LOADS} x the QPS where "
                        "long work saturates a replica (figures under --out, default "
                        "results/figure13)")
    p.add_argument("--model", default=None,
                   help="simulate: a preset (default llama3-8b); server: a model name or "
                        "path for load_model (default smollm2-135m)")
    p.add_argument("--hardware", default="a100", help="simulate: hardware preset")
    p.add_argument("--gpus", type=int, default=16,
                   help="simulate: devices in all; replicas = gpus / parallel size")
    p.add_argument("--parallel", default="tp=8,spp=2", help="simulate: e.g. tp=8,spp=2")
    p.add_argument("--long-fraction", type=float, default=0.05)
    p.add_argument("--qps", default=None,
                   help="comma list, a sweep (default 0.75 simulated, 0.5 on the server)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per run (default 1000 simulated, 40 on the server, 80 "
                        "validating)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arrival", choices=("poisson", "bursty"), default="poisson")
    p.add_argument("--short-lengths-from", default=None, metavar="AZURE_CSV",
                   help="draw short requests from lognormals fitted to this Azure trace "
                        "(e.g. shared/traces/azure2023_splitwise_conv.csv) instead of "
                        "ShareGPT4's")
    p.add_argument("--policies", default=None,
                   help=f"comma list of {','.join(ALL_POLICIES)} "
                        "(default all simulated, lars-mp,lars,fcfs-np live)")
    p.add_argument("--long-scale", type=float, default=SERVER_SCALES["long_scale"],
                   help="live: Medha-SWE long prompt lengths x this (then capped by the "
                        "context)")
    p.add_argument("--max-model-len", type=int, default=SERVER_ENGINE["max_model_len"],
                   help="live: the engine's context; its KV cache holds at least 4x this")
    p.add_argument("--short-ttft", type=float, default=SLOPolicy().short_ttft_s,
                   help="TTFT deadline of short requests, s")
    p.add_argument("--long-ttft-factor", type=float, default=SLOPolicy().long_ttft_factor,
                   help="long-request deadline = this x its predicted prefill time")
    p.add_argument("--out", default=None, help="directory for the figures (PNG)")
    p.add_argument("--json", default=None, help="write every figure and the context here")
    p.add_argument("--quick", action="store_true", help="a small run (about a minute)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.mode = ("server" if args.server else
                 "validate" if args.validate_simulator else "simulate")
    live = args.mode != "simulate"
    if args.figure13:
        if live:
            p.error("--figure13 is simulated only")
        args.policies = args.policies or ",".join(FIGURE13_POLICIES)
        args.out = args.out or "results/figure13"
    if args.model is None:
        args.model = "smollm2-135m" if live else "llama3-8b"
    if args.policies is None:
        args.policies = (("lars-mp", "lars", "fcfs-np") if live else
                         ("fcfs-np", "lars", "lars-mp") if args.quick else ALL_POLICIES)
    else:
        args.policies = tuple(x.strip() for x in args.policies.split(",") if x.strip())
    unknown = set(args.policies) - set(ALL_POLICIES)
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}; known: {','.join(ALL_POLICIES)}")
    args.qps = tuple(float(q) for q in (args.qps or ("0.5" if live else "0.75")).split(","))
    if args.requests is None:
        # Validation compares percentiles of one run: with 40 requests (2 long) they
        # hinge on which few short requests overlapped a long prefill.
        args.requests = (20 if args.quick else 80 if args.mode == "validate" else 40
                         ) if live else (300 if args.quick else 1000)
    if not args.long_scale > 0 or args.max_model_len < 128:
        p.error(f"--long-scale must be > 0 and --max-model-len >= 128, got "
                f"{args.long_scale} and {args.max_model_len}")
    if not 0 <= args.long_fraction <= 1:
        p.error(f"--long-fraction must be in [0, 1], got {args.long_fraction}")
    return args


def workload(args: argparse.Namespace, qps: float, *, max_prompt_tokens: int | None = None
             ) -> list[TraceRequest]:
    live = args.mode != "simulate"
    shapes = {}
    if args.short_lengths_from:
        shapes["short_prompt"], shapes["short_output"] = fit_lengths(
            load_azure_trace(args.short_lengths_from))
    return generate_workload(WorkloadSpec(
        num_requests=args.requests, qps=qps, long_fraction=args.long_fraction, seed=args.seed,
        arrival=args.arrival, max_prompt_tokens=max_prompt_tokens,
        **shapes, **(dict(SERVER_SCALES, long_scale=args.long_scale) if live else {})))


def server_engine_config(args: argparse.Namespace) -> dict:
    """SERVER_ENGINE at the context asked for, its cache growing with it."""
    return dict(SERVER_ENGINE, max_model_len=args.max_model_len, max_kv_tokens=max(
        SERVER_ENGINE["max_kv_tokens"], 4 * args.max_model_len))


def slo_policy(args: argparse.Namespace) -> SLOPolicy:
    return SLOPolicy(short_ttft_s=args.short_ttft, long_ttft_factor=args.long_ttft_factor)


def long_ids(trace: Sequence[TraceRequest]) -> set[str]:
    return {request_id(i) for i, r in enumerate(trace) if r.is_long}


# ---------------------------------------------------------------------------------------
# Simulated cluster
# ---------------------------------------------------------------------------------------

def simulate_policy(trace: Sequence[TraceRequest], scheduler, *, slo: SLOPolicy,
                    prefill_time_cache, progress: bool = False, **sim_kwargs
                    ) -> list[LatencyRecord]:
    """Runs one scheduler (a policy name or a SchedulerConfig) over the trace in the
    simulator and returns its records.

    prefill_time_cache: the scheduler's Algorithm 3 table for the simulator's predictor;
    it sets long requests' deadlines (SLOPolicy) and is reused by every replica and every
    policy, so all runs share one w_total. sim_kwargs go to `simulate` (model, parallel,
    hardware, num_replicas, predictor, max_model_len, ...).
    """
    from medha_jax.simulator import simulate

    # Fresh Requests per run: the controller mutates them.
    requests = to_requests(trace, slo_policy=slo, prefill_time_s=prefill_time_cache)
    result = simulate(requests, scheduler=scheduler, progress=progress,
                      prefill_time_cache=prefill_time_cache, **sim_kwargs)
    return records_from_requests(result.requests, long_ids=long_ids(trace))


def run_simulated(args: argparse.Namespace) -> tuple[dict, dict]:
    from medha_jax.scheduler import AnalyticalPredictor, hardware_preset, make_prefill_time_cache

    model = model_preset(args.model)
    parallel = ParallelConfig.parse(args.parallel)
    if args.gpus % parallel.num_devices:
        raise SystemExit(f"--gpus {args.gpus} is not a multiple of the parallel size "
                         f"{parallel.num_devices} ({parallel})")
    replicas = args.gpus // parallel.num_devices
    hardware = hardware_preset(args.hardware)
    # The simulator's own default predictor, built here so SLOs can use its prefill times.
    predictor = AnalyticalPredictor(model, dataclasses.replace(parallel, dp=1), hardware)
    runs: dict[str, dict[str, list[LatencyRecord]]] = {}
    normalized: dict[str, dict[str, list[float | None]]] = {}
    if args.figure13:
        args.qps, loads = figure13_loads(args, predictor, replicas)
    for qps in args.qps:
        trace = workload(args, qps)
        max_model_len = max(r.prompt_tokens + r.output_tokens for r in trace)
        cache = make_prefill_time_cache(predictor, max_model_len=max_model_len)
        if args.figure13:
            deadlines = [slo_policy(args).slo_for(r, cache).ttft_s for r in trace]
        runs[f"{qps:g}"] = {
            policy: simulate_policy(trace, policy, slo=slo_policy(args), prefill_time_cache=cache,
                                    progress=not args.no_progress, model=model,
                                    parallel=parallel, hardware=hardware,
                                    num_replicas=replicas, predictor=predictor,
                                    max_model_len=max_model_len)
            for policy in args.policies}
        if args.figure13:
            # Records are in trace order (records_from_requests keeps the input order).
            normalized[f"{qps:g}"] = {
                policy: [None if r.ttft_s is None else r.ttft_s / d
                         for r, d in zip(records, deadlines)]
                for policy, records in runs[f"{qps:g}"].items()}
    context = {"mode": "simulated", "predictor": f"AnalyticalPredictor ({hardware.name})",
               "hardware": hardware.name, "gpus": args.gpus, "parallel": str(parallel),
               "replicas": replicas, "model": model.name, "dtype": model.dtype}
    if args.figure13:
        context["figure13"] = {"loads": loads, "ttft_over_deadline": normalized}
    return runs, context


def figure13_loads(args: argparse.Namespace, predictor, replicas: int
                   ) -> tuple[tuple[float, ...], dict]:
    """The QPS of figure 13's three loads: FIGURE13_LOADS x the QPS at which long
    prefills alone keep every replica busy (analytically: long fraction x mean predicted
    lone prefill time x QPS = replicas), and the analytical load at each.

    A trace's lengths do not depend on its QPS (the same seed draws the same lengths),
    so one trace gives the mean prefill work per request of every load.
    """
    from medha_jax.scheduler import make_prefill_time_cache

    trace = workload(args, 1.0)
    cache = make_prefill_time_cache(
        predictor, max_model_len=max(r.prompt_tokens + r.output_tokens for r in trace))
    long_w = [cache(r.prompt_tokens) for r in trace if r.is_long]
    short_w = [cache(r.prompt_tokens) for r in trace if not r.is_long]
    mean_long = sum(long_w) / max(1, len(long_w))
    mean_short = sum(short_w) / max(1, len(short_w))
    if not long_w:
        raise SystemExit("--figure13 needs long requests (--long-fraction > 0)")
    saturation_qps = replicas / (args.long_fraction * mean_long)
    qps = tuple(round(f * saturation_qps, 4) for f in FIGURE13_LOADS)
    loads = {f"{q:g}": {
        "long_load": q * args.long_fraction * mean_long / replicas,
        "prefill_load": q * (args.long_fraction * mean_long
                             + (1 - args.long_fraction) * mean_short) / replicas}
        for q in qps}
    print(f"figure 13: long prefills saturate {replicas} replica(s) at "
          f"{saturation_qps:.3g} QPS (mean lone prefill: long {mean_long:.3g} s, short "
          f"{mean_short * 1e3:.3g} ms, simulated); loads:", flush=True)
    for q, load in loads.items():
        print(f"  {q} QPS: long prefill load {load['long_load']:.2f}, all prefill "
              f"{load['prefill_load']:.2f} (fraction of the replicas' time)", flush=True)
    return qps, {"saturation_qps": saturation_qps, "mean_long_prefill_s": mean_long,
                 "mean_short_prefill_s": mean_short, "by_qps": loads}


FIGURE13_COLUMNS = (("prefill_load", "load"), ("short_ttft_p50", "short_ttft_p50_s"),
                    ("short_ttft_p90", "short_ttft_p90_s"),
                    ("short_ttft_p99", "short_ttft_p99_s"), ("norm_p50", "ttft/d_p50"),
                    ("norm_p90", "ttft/d_p90"), ("norm_p99", "ttft/d_p99"),
                    ("short_met", "short_met_frac"), ("long_met", "long_met_frac"),
                    ("long_completed", "long_done"), ("long_total", "long_total"),
                    ("throughput_tok_s", "out_tok_per_s"))


def figure13_rows(summaries: dict, runs: dict, figure13: dict) -> dict:
    """Table rows: each summary plus the normalized TTFT (TTFT / own deadline) percentiles,
    the fraction of short and long requests within their deadline, and the load."""
    import numpy as np

    rows = {}
    for qps, by_policy in summaries.items():
        for policy, summary in by_policy.items():
            norm = figure13["ttft_over_deadline"][qps][policy]
            records = runs[qps][policy]
            values = np.array([math.inf if v is None else v for v in norm])
            is_long = np.array([r.is_long for r in records])
            rows[f"{policy}@{qps}qps"] = {
                **summary, "prefill_load": figure13["loads"]["by_qps"][qps]["prefill_load"],
                **{f"norm_p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)},
                "short_met": float(np.mean(values[~is_long] <= 1)),
                "long_met": float(np.mean(values[is_long] <= 1)) if is_long.any() else None}
    return rows


def plot_figure13(figure13: dict, out_dir: str, title: str) -> str:
    """Figure 13 of seed 000: CDFs of TTFT / deadline, one panel per load."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    by_qps = figure13["ttft_over_deadline"]
    fig, axes = plt.subplots(1, len(by_qps), figsize=(5 * len(by_qps), 4), squeeze=False)
    for ax, (qps, by_policy) in zip(axes[0], by_qps.items()):
        for policy, norm in by_policy.items():
            values = np.sort([v for v in norm if v is not None])
            ax.plot(values, np.arange(1, len(values) + 1) / len(norm), label=policy)
        load = figure13["loads"]["by_qps"][qps]["long_load"]
        ax.set(xscale="log", xlabel="TTFT / TTFT deadline", ylabel="fraction of requests",
               title=f"{qps} QPS (long load {load:.2f})")
        ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "figure13_ttft_over_deadline.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------
# Live server
# ---------------------------------------------------------------------------------------

def run_live(args: argparse.Namespace) -> tuple[dict, dict, dict | None]:
    """Replays the trace against a live Server per policy; when validating, also simulates
    the same trace with the predictor the server fitted to its engine's step times.

    One engine, compiled and calibrated once, serves every policy in turn (a Server per
    policy over it), so policies differ only in scheduling.
    """
    from medha_jax.engine import Engine, EngineConfig
    from medha_jax.engine.calibration import fit_predictor
    from medha_jax.model import load_model
    from medha_jax.scheduler import EngineLimits, SchedulerConfig
    from medha_jax.scheduler.factory import default_target_batch_time
    from serving.replay import replay_trace
    from serving.server import Server

    engine_config = server_engine_config(args)
    engine = Engine(load_model(args.model), EngineConfig(**engine_config))
    engine.warmup(progress=not args.no_progress)
    print("fitting the runtime predictor to this machine ...", flush=True)
    predictor = fit_predictor(engine)
    print(f"  {predictor}", flush=True)
    # Medha derives the batch time budget from the TPOT SLO. A CPU step costs far more than
    # an accelerator's, so the TPOT this machine is asked to meet is a budget of the
    # scheduler's kind for it, 4x the smallest step (the scheduler's default until it
    # became 8x: kept, so that the scenario and its results compare across versions),
    # not an accelerator's tens of ms.
    tpot_s = default_target_batch_time(
        predictor, EngineLimits(token_buckets=engine.ladder.token_buckets,
                                max_seqs_per_batch=engine.max_seqs), over_fixed_cost=4.0)
    slo = dataclasses.replace(slo_policy(args), tpot_s=tpot_s)
    runs: dict[str, dict[str, list[LatencyRecord]]] = {}
    validation = None
    for qps in args.qps:
        runs[f"{qps:g}"] = by_policy = {}
        # Prompt + output must fit the served context.
        trace = workload(args, qps, max_prompt_tokens=engine.max_model_len
                         - SERVER_SCALES["max_output_tokens"])
        for policy in args.policies:
            # IsLong (Algorithm 2) at the short/long boundary of these scaled lengths:
            # short prompts end at 8192 x short_scale tokens here, not at 8192.
            config = SchedulerConfig(policy, long_prefill_tokens=round(
                SchedulerConfig().long_prefill_tokens * SERVER_SCALES["short_scale"]))
            with Server(engine, scheduler=config, predictor=predictor, warmup=False,
                        default_slo=SLO(ttft_s=slo.short_ttft_s, tpot_s=slo.tpot_s)
                        ) as server:
                cache = server.controller.prefill_time_cache
                steps = (_record_steps(engine, server.controller) if args.mode == "validate"
                         else None)
                by_policy[policy] = replay_trace(
                    server, trace, vocab_size=engine.model.config.vocab_size,
                    progress=not args.no_progress, slo_policy=slo, prefill_time_s=cache,
                    seed=args.seed)
                if args.mode == "validate":
                    del engine.collect                      # drop the recording wrappers
                    validation = validation or {}
                    validation.setdefault(f"{qps:g}", {})[policy], simulated = check_simulator(
                        server, predictor, trace, slo=slo, measured=by_policy[policy],
                        steps=steps)
                    for name, records in simulated.items():
                        by_policy[f"{policy} (simulated, {name})"] = records
    context = {"mode": "live server" if args.mode == "server" else "live server + simulator",
               "model": engine.model.config.name, "dtype": engine.model.config.dtype,
               "engine": engine_config, "long_scale": args.long_scale, "tpot_slo_s": tpot_s,
               "predictor": repr(predictor)}
    return runs, context, validation


def server_twin(server, predictor) -> dict:
    """simulate() arguments that mirror a live Server (its scheduler config with the
    engine's limits and SLO default, KV capacity, one replica of one device), pricing steps
    with `predictor`."""
    from medha_jax.scheduler import HardwareSpec
    from medha_jax.simulator import kv_capacity_tokens

    config, engine = server.config, server.engine
    capacity = engine.allocator.num_pages * engine.allocator.page_size
    # The simulator sizes the KV cache from device memory minus weights; give it a device
    # whose memory holds exactly the engine's pages. Its compute peaks are never read:
    # the fitted predictor prices every step.
    bytes_per_value = 4 if config.dtype == "float32" else 2
    memory = config.num_params() * bytes_per_value + capacity * config.kv_bytes_per_token(
        bytes_per_value)
    device = HardwareSpec(name="this-engine", peak_flops=1.0, hbm_bandwidth=1.0,
                          interconnect_bandwidth=1.0, memory_bytes=memory)
    if kv_capacity_tokens(config, ParallelConfig(), device, 1.0) != capacity:
        raise RuntimeError(f"simulated KV capacity differs from the engine's {capacity} tokens")
    return dict(model=config, parallel=ParallelConfig(), hardware=device,
                memory_utilization=1.0, page_size=engine.allocator.page_size,
                predictor=predictor, max_model_len=server.max_model_len,
                scheduler=server.scheduler_config)


# TTFT and TPOT percentiles of all requests, simulated vs measured.
VALIDATED = (("ttft", 50), ("ttft", 90), ("tpot", 50), ("tpot", 90))
VALIDATION_TOLERANCE = 0.25


def compare(measured: Sequence[LatencyRecord], simulated: Sequence[LatencyRecord]) -> dict:
    """Relative error of the simulator's TTFT/TPOT percentiles against measured ones."""
    import numpy as np

    out = {}
    for metric, q in VALIDATED:
        values = {name: [getattr(r, f"{metric}_s") for r in records
                         if r.completed and getattr(r, f"{metric}_s") is not None]
                  for name, records in (("measured", measured), ("simulated", simulated))}
        m, s = (float(np.percentile(values[k], q)) for k in ("measured", "simulated"))
        out[f"{metric}_p{q}"] = {"measured_s": m, "simulated_s": s,
                                 "rel_error": abs(s - m) / m}
    out["within_tolerance"] = all(v["rel_error"] <= VALIDATION_TOLERANCE
                                  for v in out.values())
    out["tolerance"] = VALIDATION_TOLERANCE
    return out


def _record_steps(engine, controller) -> list[tuple[object, float, float]]:
    """Wraps this engine instance's collect and the controller's schedule / update to
    record (features, step seconds, iteration seconds) of every iteration (validation
    only; `del engine.collect` restores the class's method, and the controller goes with
    its server).

    Iteration seconds are the whole iteration as the server loop ran it - schedule, the
    step, update, streaming the tokens - whenever the loop went straight on to the next
    one, and the step alone before an idle wait (and for the last one). The simulator's loop costs no host time, so
    its twin of this server must run these iterations, not the bare steps: with a small
    model the host work per iteration is as long as the step.
    """
    import time

    steps: list[tuple[object, float, float]] = []
    collect, schedule, update = engine.collect, controller.schedule, controller.update
    last: dict = {}         # the previous iteration: start, features, step seconds, busy

    def recorded_schedule():
        now = time.perf_counter()
        if last:
            steps.append((last["features"], last["seconds"],
                          now - last["start"] if last["busy"] else last["seconds"]))
            last.clear()
        batch = schedule()
        if batch:
            last["start"] = now
        return batch

    def recorded_collect(pending):
        result = collect(pending)
        last["features"], last["seconds"] = engine.step_records[-1]
        return result

    def recorded_update(batch, result):
        updates = update(batch, result)
        last["busy"] = controller.has_unfinished()
        if not last["busy"]:            # the last one before an idle wait, or of the run
            steps.append((last["features"], last["seconds"], last["seconds"]))
            last.clear()
        return updates

    engine.collect = recorded_collect
    controller.schedule, controller.update = recorded_schedule, recorded_update
    return steps


def check_simulator(server, predictor, trace: Sequence[TraceRequest], *,
                    slo: SLOPolicy, measured: Sequence[LatencyRecord], steps
                    ) -> tuple[dict, dict]:
    """Simulates the trace the live server just ran, with its scheduler config, and
    compares percentiles.

    The simulated scheduler plans with `predictor`, the live server's (calibration.fit_predictor(engine),
    fitted before the run), as the live one did. The simulated device runs steps:
      "as calibrated": at the speed that predictor predicts;
      "as run":        at the speed of the same model fitted to the iterations measured
                       in this run (step plus the loop's host work, see _record_steps).
                       A shared 2-core CPU runs a live run's steps at a different speed
                       from calibration's minutes before (0.95-1.34x measured: the
                       machine drifts, and the server's and client's threads compete
                       with XLA's), so this separates the simulator's own error from
                       calibration drift. The 25% bar applies to it.
    steps: (features, step seconds, iteration seconds) from _record_steps.
    Returns (the comparison, {name: simulated records}).
    """
    from medha_jax.scheduler import ProfiledPredictor

    engine = server.engine
    cache = server.controller.prefill_time_cache
    run_fitted = ProfiledPredictor.fit([(f, iteration) for f, _, iteration in steps],
                                       token_buckets=engine.ladder.token_buckets)
    simulated, check = {}, {}
    for name, device in (("as calibrated", predictor), ("as run", run_fitted)):
        twin = server_twin(server, predictor)
        simulated[name] = simulate_policy(trace, twin.pop("scheduler"), slo=slo,
                                          prefill_time_cache=cache, **twin,
                                          device_predictor=device)
        check[name] = compare(measured, simulated[name])
    check["within_tolerance"] = check["as run"]["within_tolerance"]
    check["calibration_error_on_run_steps"] = prediction_error(
        predictor, [(f, step) for f, step, _ in steps])
    check["run_fitted_predictor"] = repr(run_fitted)
    check["requests"] = [
        {"prompt_tokens": m.prompt_tokens, "output_tokens": m.output_tokens,
         "is_long": m.is_long, "measured_ttft_s": m.ttft_s, "measured_tpot_s": m.tpot_s,
         **{f"simulated_{name.replace(' ', '_')}_{metric}_s": getattr(records[i], f"{metric}_s")
            for name, records in simulated.items() for metric in ("ttft", "tpot")}}
        for i, m in enumerate(measured)]
    return check, simulated


def prediction_error(predictor, steps) -> dict:
    """How a predictor's step times compare with measured ones: median relative error and
    median measured / predicted (above 1: the steps ran slower than predicted), over all
    steps and over decode-only steps and steps with prefill work apart."""
    import numpy as np

    def errors(subset):
        if not subset:
            return {"steps": 0}
        predicted = np.array([predictor.predict_features(f) for f, _ in subset])
        measured = np.array([seconds for _, seconds in subset])
        return {"steps": len(subset),
                "median_rel_error": float(np.median(np.abs(predicted - measured) / measured)),
                "median_measured_over_predicted": float(np.median(measured / predicted))}

    decode_only = [(f, s) for f, s in steps if f.tokens == f.seqs]
    with_prefill = [(f, s) for f, s in steps if f.tokens > f.seqs]
    return {**errors(steps), "decode_only": errors(decode_only),
            "with_prefill": errors(with_prefill)}


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------

def write_figures(runs: dict[str, dict[str, list[LatencyRecord]]], out_dir: str,
                  title: str) -> list[str]:
    from benchmarks.plots import plot_ttft_cdfs, plot_ttft_over_time

    panels = {f"{qps} QPS": by_policy for qps, by_policy in runs.items()}
    paths = [plot_ttft_cdfs(panels, os.path.join(out_dir, "ttft_cdf_short.png"),
                            request_class="short", title=f"{title}: short requests"),
             plot_ttft_cdfs(panels, os.path.join(out_dir, "ttft_cdf_long.png"),
                            request_class="long", title=f"{title}: long requests")]
    for qps, by_policy in runs.items():
        paths.append(plot_ttft_over_time(
            by_policy, os.path.join(out_dir, f"ttft_over_time_qps{qps}.png"),
            title=f"{title}, {qps} QPS"))
    return paths


def print_validation(title: str, predictor: str, check: dict) -> None:
    calibration = check["calibration_error_on_run_steps"]
    print(f"\nsimulator vs measured, {title}, {predictor}: on this run's "
          f"{calibration['steps']} steps its median error is "
          f"{calibration['median_rel_error']:.1%}, measured/predicted "
          f"{calibration['median_measured_over_predicted']:.2f} (decode-only steps "
          f"{calibration['decode_only'].get('median_measured_over_predicted', 0):.2f}, "
          f"steps with prefill "
          f"{calibration['with_prefill'].get('median_measured_over_predicted', 0):.2f})")
    for name in ("as calibrated", "as run"):
        result = check[name]
        print(f"  simulated device running steps {name}:")
        for metric, q in VALIDATED:
            v = result[f"{metric}_p{q}"]
            print(f"    {metric}_p{q}: measured {v['measured_s']:.4g} s, simulated "
                  f"{v['simulated_s']:.4g} s, error {v['rel_error']:.1%}")
        print(f"    all within {VALIDATION_TOLERANCE:.0%}: {result['within_tolerance']}")


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.mode == "simulate":
        runs, context = run_simulated(args)
        validation = None
    else:
        runs, context, validation = run_live(args)
    context.update(environment(), workload={
        "requests": args.requests, "long_fraction": args.long_fraction, "seed": args.seed,
        "arrival": args.arrival, "qps": list(args.qps),
        "short_lengths": args.short_lengths_from or "ShareGPT4 (Sarathi-Serve Table 2)",
        "slo": dataclasses.asdict(slo_policy(args))},
        command=" ".join(["python -m benchmarks.convoy"] + list(sys.argv[1:] if argv is None
                                                                   else argv)))
    summaries = {qps: {policy: summarize(records) for policy, records in by_policy.items()}
                 for qps, by_policy in runs.items()}
    report = {"context": context, "results": summaries}
    if validation is not None:
        report["validation"] = validation
    figure13 = context.get("figure13")
    if args.out:
        title = f"{context['model']} ({context['mode']})"
        report["figures"] = write_figures(runs, args.out, title)
        if figure13:
            report["figures"].append(plot_figure13(
                figure13, args.out, f"{title}, {context['hardware']} {context['parallel']}, "
                f"{args.long_fraction:.0%} long: TTFT normalized by its deadline"))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    for qps, by_policy in (validation or {}).items():
        for policy, check in by_policy.items():
            print_validation(f"{policy} at {qps} QPS", context["predictor"], check)
    rows = {f"{policy}@{qps}qps": s for qps, by_policy in summaries.items()
            for policy, s in by_policy.items()}
    print(f"\n{context['mode']}: {context['model']}, {context.get('hardware', '')} "
          f"{context.get('parallel', '')}".rstrip())
    if figure13:
        print(format_table(figure13_rows(summaries, runs, figure13), label="policy@load",
                           columns=FIGURE13_COLUMNS))
    else:
        print(format_table(rows, label="policy@load"))
    return report


if __name__ == "__main__":
    main()
