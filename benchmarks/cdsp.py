"""Chunkwise dynamic sequence parallelism (seed 001, Tetris): the prefill pool, simulated.

    python -m benchmarks.cdsp --quick                # about a minute on a 2-core CPU
    python -m benchmarks.cdsp --json results/cdsp.json

The paper's setup (section 7.1), simulated with `medha_jax.cluster.prefill_pool_sim`:
  - 8B: Llama-3 8B on 32 A100s in 4 nodes, P/D 1:1, so a prefill pool of 16 TP=1 instances
    on 2 nodes (the 2 decode TP=8 instances are not simulated: TTFT ends at the last prefill
    chunk). Chunk times: Eq. 1 fitted per SP size to the paper's Table 1 (A100 measurements,
    SP 1..16; gamma = 2 delta, see `table1_latency_models`).
  - 70B: Llama-3 70B on 64 A100s in 8 nodes, TP=4 everywhere, P/D 1:1: 8 prefill instances,
    2 per node. No table exists for it: Eq. 1's coefficients are the 8B fit's scaled by FLOPs
    (beta by parameters / 4, gamma and delta by layers x hidden / 4, alpha by layers) -- an
    estimate, marked "scaled" below. Fixed SP 8 and 16 GPUs are 2 and 4 instances there.
  - Prompts: the Short / Medium / Long ranges and averages of section 7.1 as clipped
    lognormals (`workloads.TETRIS_*_PROMPT`); Poisson arrivals at `--rate-points` rates up
    to the pool's capacity (or in steps of `--rate-step`; the paper profiles per 0.5 req/s).
  - Systems: CDSP with the improvement rate chosen per arrival rate by the offline search
    (profiled on other samples of the same distribution, least mean TTFT) and applied from a
    60 s sliding window every 30 s; CDSP restricted to aligned power-of-two groups;
    CDSP without chunking (the paper's single-chunk ablation); request-level elastic SP
    (LoongServe-style: one SP size per request at arrival, for its own least TTFT); fixed
    SP 8 and 16 (independent groups, each request to the group that finishes it first).
  - Max sustainable rate: the highest rate of the grid whose p99 TTFT is within the SLO,
    25x the lightest rate's best p50 TTFT (the paper normalises to "25[x] of the light-load
    latency"). The issue's bar: CDSP's p50 TTFT at least 1.6x lower than the best fixed SP's
    at that baseline's max sustainable rate (8B).

Tables: (a) TTFT and max rate per trace and system; (b) the improvement-rate sweep (p50
TTFT of each fixed r over the dynamic one); (c) scheduler latency (CPU time of one
`CdspScheduler.plan` on this CPU) over random trials at pools of 8..128 instances, on queue
states drawn uniformly and on states taken from simulated runs: the planner as installed
(compiled by mypyc when it could be) and, when that is compiled, its source interpreted;
with --baseline REF also the scheduler as of a git ref; all timed on the same trials,
interleaved, and checked to plan the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time
from collections.abc import Sequence

import numpy as np

from benchmarks.report import environment, table

RATE_CANDIDATES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cdsp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer requests and rates")
    p.add_argument("--json", default=None, help="write every figure and the context here")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per simulation (default 2000; --quick 500)")
    p.add_argument("--rate-step", type=float, default=None,
                   help="arrival-rate grid step, req/s (default: the pool's capacity / "
                        "--rate-points, so every setup and trace gets the same resolution)")
    p.add_argument("--rate-points", type=int, default=None,
                   help="rates up to the pool's capacity (default 16; --quick 8)")
    p.add_argument("--traces", default=None,
                   help="comma-separated of short,medium,long (default all; --quick short)")
    p.add_argument("--setups", default=None, help="8b,70b (default both; --quick 8b)")
    p.add_argument("--trials", type=int, default=None,
                   help="scheduler-latency trials per pool size (default 1000; --quick 200)")
    p.add_argument("--repeats", type=int, default=5,
                   help="scheduler latency: calls per trial for the min-of-repeats column "
                        "(a shared, noisy CPU inflates single calls)")
    p.add_argument("--baseline", default=None,
                   help="scheduler latency: also time CdspScheduler as of this git ref, on "
                        "the same trials interleaved, and check it returns the same plans")
    p.add_argument("--samples", type=int, default=1,
                   help="independent traces per rate (default 1), percentiles over all "
                        "their requests: near a system's knee one trace's p99 passes or fails "
                        "the SLO by chance, so the critical rate, and the p50 gain read "
                        "there, move between seeds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", default="", help="comma-separated parts to skip (a, b, c)")
    return p.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class Setup:
    name: str
    instances: int
    node_size: int
    models: dict
    fixed: tuple[int, ...]        # fixed SP sizes, in instances
    gpus_per_instance: int


def setups() -> dict[str, Setup]:
    from medha_jax.config import model_preset
    from medha_jax.scheduler.cdsp import LatencyModel, table1_latency_models

    m8 = table1_latency_models()
    small, large = model_preset("llama3-8b"), model_preset("llama3-70b")
    lin = large.num_params() / small.num_params() / 4
    att = large.num_layers * large.hidden_size / (small.num_layers * small.hidden_size) / 4
    const = large.num_layers / small.num_layers
    m70 = {s: LatencyModel(s, m.alpha * const, m.beta * lin, m.gamma * att, m.delta * att)
           for s, m in m8.items() if s <= 8}
    return {"8b": Setup("llama3-8b, 16 prefill A100s (Table 1 fit)", 16, 8, m8, (8, 16), 1),
            "70b": Setup("llama3-70b, 8 prefill TP4 instances (scaled)", 8, 2, m70, (2, 4), 4)}


def traces():
    from medha_jax.workloads import (TETRIS_LONG_PROMPT, TETRIS_MEDIUM_PROMPT,
                                     TETRIS_SHORT_PROMPT)
    return {"short": TETRIS_SHORT_PROMPT, "medium": TETRIS_MEDIUM_PROMPT,
            "long": TETRIS_LONG_PROMPT}


def systems(setup: Setup, tables: dict):
    """name -> (scheduler factory, improvement-rate factory)."""
    from medha_jax.scheduler.cdsp import (AdaptiveImprovementRate, CdspConfig, CdspScheduler,
                                          FixedSpScheduler)

    def cdsp(**kw):
        return lambda: CdspScheduler(setup.instances, setup.models,
                                     CdspConfig(node_size=setup.node_size, **kw))

    out = {"cdsp": (cdsp(), lambda: AdaptiveImprovementRate(tables["cdsp"])),
           "cdsp-aligned": (cdsp(aligned=True),
                            lambda: AdaptiveImprovementRate(tables["cdsp-aligned"])),
           "cdsp-single-chunk": (cdsp(chunking=False),
                                 lambda: AdaptiveImprovementRate(tables["cdsp-single-chunk"])),
           "elastic-sp": (cdsp(chunking=False, improvement_rate=0.0), lambda: 0.0)}
    for sp in setup.fixed:
        out[f"fixed-sp{sp * setup.gpus_per_instance}"] = (
            (lambda sp=sp: FixedSpScheduler(setup.instances, sp, setup.models[sp])),
            lambda: None)
    return out


def rate_grid(setup: Setup, dist, step: float | None, points: int) -> list[float]:
    """Rates in steps up to the pool's capacity at its most efficient SP size (no request is
    served in fewer instance-seconds; no system sustains more): `points` of them, or steps
    of `step` req/s (the paper profiles in steps of 0.5)."""
    mean_len = float(np.mean(dist.sample(np.random.default_rng(99), 20000)))
    best_per_instance = min(s * m.seconds(0, mean_len) for s, m in setup.models.items())
    top = setup.instances / best_per_instance
    step = step or float(f"{top / points:.2g}")
    return [round(step * k, 6) for k in range(1, int(top / step + 1e-9) + 1)]


# Seeds of the extra samples per rate: far from the rate index (< 100) and from the
# improvement-rate profile's seeds (args.seed + 7919 + 1000 i).
SAMPLE_SEED_STRIDE = 100_003


def merge_results(results):
    """Independent simulations of one rate as one result: their requests together (the
    percentiles are over all of them), busy time and makespan summed."""
    from medha_jax.cluster.prefill_pool_sim import PoolResult

    if len(results) == 1:
        return results[0]
    return PoolResult(*(sum((getattr(r, f) for r in results), start)
                        for f, start in (("ttft_s", []), ("plans", []),
                                         ("improvement_rates", []), ("decision_s", []),
                                         ("busy_instance_s", 0.0), ("makespan_s", 0.0))))


def run_setup(args, setup: Setup, trace: str, dist, num_requests: int):
    from medha_jax.cluster.prefill_pool_sim import (poisson_arrivals,
                                                    profile_improvement_rates,
                                                    simulate_prefill_pool)
    from medha_jax.scheduler.cdsp import CdspConfig, CdspScheduler

    rates = rate_grid(setup, dist, args.rate_step, args.rate_points)

    def sample(n, seed):
        return dist.sample(np.random.default_rng(seed), n)

    # The offline search, on other samples than the evaluation's (as many traces per rate
    # as the evaluation, --samples); the aligned and single-chunk variants reuse CDSP's
    # table (one profile per setup and trace keeps the run short; their own would suit them
    # a little better).
    table_ = profile_improvement_rates(
        sample, rates, RATE_CANDIDATES,
        lambda: CdspScheduler(setup.instances, setup.models,
                              CdspConfig(node_size=setup.node_size)),
        num_requests=num_requests, seed=args.seed + 7919, samples=args.samples)
    tables = {"cdsp": table_, "cdsp-aligned": table_, "cdsp-single-chunk": table_}
    results = {}   # (system, rate) -> PoolResult
    sweep = {}     # (r, rate) -> p50 with a fixed improvement rate
    for k, rate in enumerate(rates):
        # --samples independent traces per rate (sample 0: the seeds of a one-sample run),
        # every system on the same ones; percentiles over all their requests.
        traces_ = [(sample(num_requests, args.seed + k + SAMPLE_SEED_STRIDE * j),
                    poisson_arrivals(num_requests, rate, args.seed + k + SAMPLE_SEED_STRIDE * j))
                   for j in range(args.samples)]
        for name, (make, make_r) in systems(setup, tables).items():
            results[name, rate] = merge_results([
                simulate_prefill_pool(lengths, arrivals, make(), improvement_rate=make_r())
                for lengths, arrivals in traces_])
        for r in RATE_CANDIDATES:
            res = merge_results([
                simulate_prefill_pool(lengths, arrivals, systems(setup, tables)["cdsp"][0](),
                                      improvement_rate=r)
                for lengths, arrivals in traces_])
            sweep[r, rate] = res.percentile(50)
    names = list(systems(setup, tables))
    slo = 25 * min(results[name, rates[0]].percentile(50) for name in names)
    max_rate = {name: max((rate for rate in rates
                           if results[name, rate].percentile(99) <= slo), default=0.0)
                for name in names}
    fixed = [n for n in names if n.startswith("fixed")]
    best_fixed = max(fixed, key=lambda n: (max_rate[n], -results[n, max_rate[n] or rates[0]]
                                           .percentile(50)))
    critical = max_rate[best_fixed] or rates[0]
    rows = []
    for name in names:
        res = results[name, critical]
        rows.append({
            "setup": setup.name.split(",")[0], "trace": trace, "system": name,
            "max_rate_req_s": max_rate[name], "at_rate_req_s": critical,
            "ttft_p50_s": res.percentile(50), "ttft_p99_s": res.percentile(99),
            "p50_gain_vs_best_fixed": results[best_fixed, critical].percentile(50)
            / res.percentile(50),
            "p99_gain_vs_best_fixed": results[best_fixed, critical].percentile(99)
            / res.percentile(99),
            "mean_r": float(np.nanmean(res.improvement_rates)) if name.startswith("cdsp")
            else float("nan")})
    curves = [{"setup": setup.name, "trace": trace, "system": name, "rate_req_s": rate,
               "ttft_p50_s": results[name, rate].percentile(50),
               "ttft_p99_s": results[name, rate].percentile(99)}
              for name in names for rate in rates]
    sweep_rows = []
    for rate in rates:
        dynamic = results["cdsp", rate].percentile(50)
        sweep_rows.append({"setup": setup.name.split(",")[0], "trace": trace,
                           "rate_req_s": rate, "dynamic_p50_s": dynamic,
                           "profiled_r": tables["cdsp"].lookup(rate),
                           **{f"r{r:g}_over_dynamic": sweep[r, rate] / dynamic
                              for r in RATE_CANDIDATES}})
    return rows, curves, sweep_rows, {"slo_p99_s": slo, "best_fixed": best_fixed,
                                      "critical_rate": critical, "rates": rates,
                                      "profile": dataclasses.asdict(table_)}


def timing_models():
    """Eq. 1 models for SP 1..128 for timing the scheduler only: Table 1's fit to 16, then
    each doubling halves the per-token terms and adds half of alpha (ring latency)."""
    from medha_jax.scheduler.cdsp import LatencyModel, table1_latency_models

    models = table1_latency_models()
    for s in (32, 64, 128):
        m = models[s // 2]
        models[s] = LatencyModel(s, m.alpha * 1.5, m.beta / 2, m.gamma / 2, m.delta / 2)
    return models


def baseline_scheduler_module(ref: str):
    """medha_jax/scheduler/cdsp.py as of git `ref`, imported under another name (for the
    before/after latency table; not a second implementation anyone calls)."""
    import subprocess
    import sys
    import types

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(["git", "show", f"{ref}:medha_jax/scheduler/cdsp.py"], cwd=root,
                            check=True, capture_output=True, text=True).stdout
    name = f"_cdsp_at_{ref}".replace("-", "_").replace("~", "_").replace("^", "_")
    module = sys.modules[name] = types.ModuleType(name)   # dataclasses look the module up
    exec(compile(source, f"{ref}:medha_jax/scheduler/cdsp.py", "exec"), module.__dict__)
    return module


def _chunks(plan) -> list[tuple]:
    """A plan's chunks as plain values (a baseline may return numpy floats where the
    queues were numpy floats; the comparison is of values)."""
    return [(c.tokens, c.history, tuple(c.group), float(c.start_s), float(c.end_s))
            for c in plan.chunks]


def scheduler_latency(args, trials: int) -> list[dict]:
    from medha_jax.cluster.prefill_pool_sim import poisson_arrivals
    from medha_jax.scheduler import cdsp
    from medha_jax.scheduler.cdsp import CdspConfig, CdspScheduler, book_plan
    from medha_jax.workloads import TETRIS_LONG_PROMPT

    from medha_jax.scheduler import cdsp_search

    # name -> (module, keyword arguments of its CdspScheduler)
    impls = {"compiled" if cdsp.PLANNER_COMPILED else "interpreted": (cdsp, {})}
    if cdsp.PLANNER_COMPILED:
        impls["interpreted"] = (cdsp, {"planner": cdsp_search})
    if args.baseline:
        impls[args.baseline] = (baseline_scheduler_module(args.baseline), {})
    models = timing_models()
    rows = []
    for states in ("uniform", "simulated"):
        for aligned in (False, True):
            for n in (8, 16, 32, 64, 128):
                scheduler = CdspScheduler(n, models, CdspConfig(aligned=aligned))
                rng = random.Random(args.seed + n)
                cases = []
                if states == "uniform":   # each instance's queue uniform in [0, 5 s]
                    for _ in range(trials):
                        cases.append(([rng.uniform(0, 5) for _ in range(n)],
                                      rng.randint(16_000, 190_000),
                                      rng.choice(RATE_CANDIDATES)))
                else:   # the queues a CDSP pool has at arrivals, loads 20%..100%
                    lengths = TETRIS_LONG_PROMPT.sample(np.random.default_rng(n), trials)
                    capacity = n / (models[1].seconds(0, 50_100))
                    queues = [0.0] * n
                    gaps = np.diff(poisson_arrivals(trials + 1, 1.0, n))
                    for k in range(trials):
                        load = 0.2 + 0.8 * rng.random()
                        r = rng.choice(RATE_CANDIDATES)
                        cases.append((list(queues), int(lengths[k]), r))
                        book_plan(queues, scheduler.plan(int(lengths[k]), queues, r))
                        dt = gaps[k] / (load * capacity)
                        queues = [max(0.0, q - dt) for q in queues]
                schedulers = {name: m.CdspScheduler(n, models, m.CdspConfig(aligned=aligned),
                                                    **kw)
                              for name, (m, kw) in impls.items()}
                cpu = {name: [] for name in impls}
                wall = {name: [] for name in impls}
                least = {name: [] for name in impls}
                order = list(schedulers.items())
                for q, tokens, r in cases:   # implementations interleaved, trial by trial
                    plans = {}
                    # Who goes first meets the trial's queue state cold in the CPU's
                    # caches (its single-call time ~10% higher): the order alternates.
                    order.reverse()
                    for name, sched in order:
                        t0, c0 = time.perf_counter(), time.thread_time()
                        plans[name] = sched.plan(tokens, q, r)
                        c1, t1 = time.thread_time(), time.perf_counter()
                        cpu[name].append(c1 - c0)
                        wall[name].append(t1 - t0)
                        best = c1 - c0
                        for _ in range(args.repeats - 1):
                            c0 = time.thread_time()
                            sched.plan(tokens, q, r)
                            best = min(best, time.thread_time() - c0)
                        least[name].append(best)
                    if len({repr(_chunks(p)) for p in plans.values()}) != 1:
                        raise AssertionError(f"{states} n={n} aligned={aligned}: the "
                                             f"implementations plan {tokens} tokens "
                                             f"differently")
                for name in impls:
                    cpu_us, wall_us = np.array(cpu[name]) * 1e6, np.array(wall[name]) * 1e6
                    min_us = np.array(least[name]) * 1e6
                    rows.append({"impl": name, "states": states,
                                 "groups": "aligned" if aligned else "free",
                                 "max_sp": n, "trials": trials,
                                 "cpu_p50_us": float(np.percentile(cpu_us, 50)),
                                 "cpu_p99_us": float(np.percentile(cpu_us, 99)),
                                 "cpu_mean_us": float(cpu_us.mean()),
                                 "min_p50_us": float(np.percentile(min_us, 50)),
                                 "min_p99_us": float(np.percentile(min_us, 99)),
                                 "wall_p50_us": float(np.percentile(wall_us, 50)),
                                 "wall_p99_us": float(np.percentile(wall_us, 99))})
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    skip = set(args.skip.split(",")) - {""}
    num_requests = args.requests or (500 if args.quick else 2000)
    trace_names = (args.traces.split(",") if args.traces
                   else ["short"] if args.quick else ["short", "medium", "long"])
    setup_names = (args.setups.split(",") if args.setups
                   else ["8b"] if args.quick else ["8b", "70b"])
    trials = args.trials or (200 if args.quick else 1000)
    args.rate_points = args.rate_points or (8 if args.quick else 16)
    all_setups, all_traces = setups(), traces()
    rows, curves, sweeps, info = [], [], [], {}
    if "a" not in skip or "b" not in skip:
        for s in setup_names:
            for t in trace_names:
                r, c, sw, inf = run_setup(args, all_setups[s], t, all_traces[t], num_requests)
                rows += r
                curves += c
                sweeps += sw
                info[f"{s}/{t}"] = inf
    latency = [] if "c" in skip else scheduler_latency(args, trials)
    if sweeps and "b" not in skip:
        table("(b) simulated: improvement-rate sweep, CDSP p50 TTFT at each fixed r over the "
              "dynamic rate's (Eq. 1 per setup as in (a))", sweeps)
    if latency:
        table(f"(c) measured: CdspScheduler.plan latency on this CPU, {trials} random "
              "trials per max SP (node size 8, SP candidates powers of two up to the pool); "
              "compiled: by mypyc at install; interpreted: the same source in CPython; "
              f"cpu: one call's thread CPU time; min: the least of {args.repeats} calls "
              "per trial" + (f"; {args.baseline}: the scheduler at that git ref" if
                             args.baseline else "") + "; every row plans the same", latency)
    if rows and "a" not in skip:
        for key, inf in info.items():
            print(f"{key}: SLO p99 TTFT {inf['slo_p99_s']:.2f} s; best fixed "
                  f"{inf['best_fixed']}, critical rate {inf['critical_rate']} req/s; "
                  f"profiled r per rate {inf['profile']}")
        table(f"(a) simulated (prefill pool, Eq. 1 chunk times, {args.samples} x "
              f"{num_requests} Poisson requests per point): max sustainable rate (p99 TTFT <= SLO) and TTFT at the "
              "best fixed SP's max sustainable rate", rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"context": {**environment(), "simulated": True,
                                   "predictor": "Eq. 1 fitted to seed 001 Table 1 (A100); "
                                                "70B scaled by FLOPs",
                                   "requests": num_requests, "samples": args.samples,
                                   "rate_step": args.rate_step,
                                   "rate_points": args.rate_points,
                                   "seed": args.seed},
                       "summary": rows, "curves": curves, "improvement_rate_sweep": sweeps,
                       "scheduler_latency": latency, "setups": info}, f, indent=2)


if __name__ == "__main__":
    main()
