"""DP <-> TP switch latency on this machine (seed 004, Flying Serving: 15 ms live on 8 x H200).

    python -m benchmarks.switching --quick          # about two minutes on a 2-core CPU
    python -m benchmarks.switching --dp 8 --json results/switching.json

`--dp` single-device base replicas of the tiny model (the CPU's virtual devices with
XLA_FLAGS=--xla_force_host_platform_device_count=8) under `SwitchingCoordinator` with the
"priority" policy and hard preemption: every replica decodes a DP request, then a
high-priority request binds the aligned group of `--group` replicas at once. The switch
latency is the paper's: from the decision at the iteration boundary to the first TP step
dispatched (its inputs built, the members' cache buffers assembled into the group's arrays,
the step enqueued). Everything is compiled and run once at warm-up, so no switch compiles.
Also timed alone: assembling the group's cache view from the members' buffers (what a bind
adds to a step; the weights' views are assembled once, when the group is built).

On a CPU this bounds the host's share of a switch only: the paper's 15 ms includes
NCCL's first collective on GPUs, which needs >= 2 GPUs to measure.

    python -m benchmarks.switching --sim --quick    # simulated, 400 requests, ~1 min
    python -m benchmarks.switching --sim --json results/switching_sim.json

`--sim` runs the paper's evaluation in the simulator instead (no devices): the live
`SwitchingCoordinator` over simulated engines (medha_jax.cluster.switching_sim) on
`--hardware` (h200) x `--devices` (8) with `--model` (llama3-70b). Llama-3-70B's bf16
weights (141 GB) do not fit one 140 GiB H200 with room for KV, so a base replica is
`--base-tp` (2) devices: static DP = 4 x TP-2 replicas, static TP = 1 x TP-8, switching =
the 4 TP-2 replicas binding aligned groups of 2 or 4 (TP-4, TP-8) under a policy. All three
run through the same coordinator loop (static ones with policy "off"), on the paper's
workload (`workloads.AlternatingLoadSpec`: prompts U[128, 4000], outputs U[64, 512],
2-5 req/s phases alternating with 10-30 req/s bursts, 4000 requests, seeded); static DP is
also shown as independent replicas behind the router (`simulate()`): the coordinator's
units step independently too (each applied when its own step ends), so the two differ only
in where requests are placed (least loaded at arrival vs the router). Tables: TTFT /
throughput (Fig. 8-9), priority (Table 1: a high-priority fraction binding a group with
hard preemption, 3-5 req/s) and each configuration's max context (Table 2, from
kv_capacity_tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence

import numpy as np

from benchmarks.report import environment, table

PAPER_SWITCH_MS = 15.0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.switching", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="20 switches instead of 100")
    p.add_argument("--json", default=None, help="write every figure and the context here")
    p.add_argument("--dp", type=int, default=4, help="base replicas (devices)")
    p.add_argument("--group", type=int, default=None, help="TP degree bound (default: --dp)")
    p.add_argument("--switches", type=int, default=None)
    sim = p.add_argument_group("--sim: the paper's evaluation in the simulator")
    sim.add_argument("--sim", action="store_true", help="run the simulated tables instead")
    sim.add_argument("--requests", type=int, default=None, help="default 4000 (--quick 400)")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--model", default="llama3-70b")
    sim.add_argument("--hardware", default="h200")
    sim.add_argument("--devices", type=int, default=8)
    sim.add_argument("--base-tp", type=int, default=2, help="devices per base replica")
    sim.add_argument("--scheduler", default="sarathi-2048",
                     help="every unit's scheduler (vLLM-like FCFS chunked prefill)")
    sim.add_argument("--load-max-queued", type=int, default=None,
                     help="SwitchingConfig.load_max_queued (default: its default)")
    sim.add_argument("--tp-group", type=int, default=None,
                     help="base replicas a 'load' / 'priority' group binds (default: all)")
    sim.add_argument("--priority-fraction", type=float, default=0.1,
                     help="Table 1: share of high-priority requests")
    return p.parse_args(argv)


def percentile(values, q):
    return float(np.percentile(np.asarray(values), q))


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.sim:
        return simulated_tables(args)
    from medha_jax import ParallelConfig
    from medha_jax.engine import Engine, EngineConfig
    from medha_jax.request import Request, VirtualClock
    from medha_jax.sampling_params import SamplingParams
    from medha_jax.scheduler.predictor import AnalyticalPredictor
    from serving.replicas import replica_models
    from serving.switching import SwitchingConfig, SwitchingCoordinator

    switches = args.switches or (20 if args.quick else 100)
    group = args.group or args.dp
    config = EngineConfig(page_size=16, max_kv_tokens=512, max_model_len=256,
                          max_tokens_per_step=32, max_seqs=8, enable_prefix_caching=False)
    engines = [Engine(m, config) for m in replica_models("tiny", args.dp)]
    predictor = AnalyticalPredictor(engines[0].model.config, ParallelConfig(), "h100",
                                    token_buckets=engines[0].ladder.token_buckets)
    coordinator = SwitchingCoordinator(
        engines, SwitchingConfig("priority", group_sizes=(group,), priority_threshold=-1),
        predictor=predictor, clock=VirtualClock())
    start = time.perf_counter()
    coordinator.warmup()
    warmup_s = time.perf_counter() - start
    rng = np.random.default_rng(0)

    def request(rid, n, priority=0):
        prompt = [int(t) for t in rng.integers(1, 256, size=16)]
        return Request(rid, 16, n, 0.0, priority=priority, prompt_token_ids=prompt,
                       sampling=SamplingParams(temperature=0.0, max_tokens=n))

    for i in range(switches):
        for r in range(args.dp):
            coordinator.submit(request(f"dp{i}.{r}", 8))
        coordinator.step()
        coordinator.step()
        coordinator.submit(request(f"vip{i}", 2, priority=-1))
        while f"vip{i}" not in coordinator.finished:
            coordinator.step()
    coordinator.run()
    latencies_ms = [1e3 * s for s in coordinator.switch_latencies_s]
    tp = coordinator.groups[(0, group)].engine
    view_ms = []
    for _ in range(200):
        t = time.perf_counter()
        tp.kv_cache                                   # noqa: B018  (the assembly is the work)
        view_ms.append(1e3 * (time.perf_counter() - t))
    results = {
        "dp": args.dp, "group": group, "switches": len(latencies_ms),
        "switch_ms_p50": percentile(latencies_ms, 50),
        "switch_ms_p99": percentile(latencies_ms, 99),
        "cache_view_ms_p50": statistics.median(view_ms),
        "mode_changes": dict(coordinator.mode_changes), "warmup_s": warmup_s,
        "paper_switch_ms": PAPER_SWITCH_MS, "context": environment(),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    table(f"DP <-> TP switch latency, decision to first TP step dispatched ({args.dp} base "
          f"replicas, TP-{group}, tiny model, this machine)",
          [{"what": "switch (this run)", "p50 ms": results["switch_ms_p50"],
            "p99 ms": results["switch_ms_p99"], "n": len(latencies_ms)},
           {"what": "cache view assembly alone", "p50 ms": results["cache_view_ms_p50"],
            "p99 ms": percentile(view_ms, 99), "n": len(view_ms)},
           {"what": "Flying Serving (8 x H200, Llama-3-70B)", "p50 ms": PAPER_SWITCH_MS,
            "p99 ms": float("nan"), "n": "-"}])
    return results


# The paper's figures (seed 004, sec. 6; Llama-3-70B on 8 x H200).
PAPER = {"ttft_p90_tp_over_switching": 1.66, "peak_tok_s_switching_over_dp": 3059 / 3169,
         "table1": {"static TP": (22, 22, 63, 2130, 2530), "static DP": (32, 32, 166, 166, 3164),
                    "switching": (24, 28, 74, 142, 3040)},
         "table2_tokens": {"4DPx2TP": 264e3, "2DPx4TP": 959e3, "1DPx8TP": 2.3e6,
                           "switching": 1.9e6}}


def simulated_tables(args) -> dict:
    """The --sim section: every configuration through the live coordinator's loop over
    simulated engines (see the module docstring)."""
    from medha_jax.cluster.switching_sim import drive, switching_units
    from medha_jax.config import ParallelConfig, model_preset
    from medha_jax.scheduler import SchedulerConfig
    from medha_jax.scheduler.predictor import AnalyticalPredictor
    from medha_jax.simulator import kv_capacity_tokens, simulate
    from medha_jax.scheduler.hardware import hardware_preset
    from medha_jax.workloads import AlternatingLoadSpec, alternating_load_workload, to_requests
    from serving.switching import SwitchingConfig, SwitchingCoordinator

    model, hardware = model_preset(args.model), hardware_preset(args.hardware)
    base, num = args.base_tp, args.devices // args.base_tp
    if num * base != args.devices or num & (num - 1):
        raise SystemExit(f"--devices {args.devices} must be a power-of-two multiple of "
                         f"--base-tp {base}")
    group_sizes = tuple(m for m in (2, 4, 8, 16) if m <= num)
    requests_n = args.requests or (400 if args.quick else 4000)
    buckets = (16, 32, 64, 128, 256, 512, 1024, 2048)
    sched = SchedulerConfig(args.scheduler, token_buckets=buckets)
    knobs = {k: v for k, v in (("load_max_queued", args.load_max_queued),
                               ("tp_group_size", args.tp_group)) if v is not None}

    def run(requests, policy, replicas, tp, **config):
        units = switching_units(model, hardware=hardware, num_replicas=replicas, base_tp=tp,
                                group_sizes=group_sizes if policy != "off" else (),
                                token_buckets=buckets, max_seqs=sched.max_seqs_per_batch)
        predictor = AnalyticalPredictor(model, ParallelConfig(tp=tp), hardware,
                                        token_buckets=buckets)
        coordinator = SwitchingCoordinator(
            units.replicas, SwitchingConfig(policy, group_sizes=group_sizes or (2,), **config),
            predictor=predictor, scheduler_config=sched, clock=units.clock, groups=units.groups)
        start = time.perf_counter()
        result = drive(coordinator, units, requests)
        return result, coordinator, time.perf_counter() - start

    def row(name, result, coordinator, wall_s):
        s = result.stats()
        return {"configuration": name, "ttft_p50_s": s["ttft_s_p50"],
                "ttft_p90_s": s["ttft_s_p90"], "ttft_mean_s": s["ttft_s_mean"],
                "tpot_p50_ms": 1e3 * s["tpot_s_p50"], "queue_mean_s": s["queue_s_mean"],
                "tok_per_s": result.throughput_tok_s(),
                "peak_tok_per_s": result.peak_throughput_tok_s(),
                "binds": coordinator.mode_changes.get("bind", 0),
                "requests_per_mode": " ".join(f"{k}:{v}" for k, v in
                                              sorted(coordinator.requests_per_mode.items())),
                "sim_wall_s": wall_s}

    # Fig. 8-9: TTFT and throughput under alternating bursts.
    trace, _ = alternating_load_workload(AlternatingLoadSpec(num_requests=requests_n,
                                                             seed=args.seed))
    requests = to_requests(trace)
    runs = {"static DP": run(requests, "off", num, base),
            "static TP": run(requests, "off", 1, args.devices),
            "switching (load)": run(requests, "load", num, base, **knobs)}
    rows = [row(f"{k} ({num}xTP-{base})" if k != "static TP" else
                f"{k} (1xTP-{args.devices})", *v) for k, v in runs.items()]
    start = time.perf_counter()
    independent = simulate(requests, scheduler=sched, model=model,
                           parallel=ParallelConfig(tp=base), hardware=hardware,
                           num_replicas=num, max_model_len=model.max_position_embeddings)
    wall = time.perf_counter() - start
    ttft = np.array([r.first_token_time - r.arrival_time for r in independent.requests])
    tpot = [(r.finish_time - r.first_token_time) / (len(r.output_token_ids) - 1)
            for r in independent.requests if len(r.output_token_ids) > 1]
    out_tokens = sum(len(r.output_token_ids) for r in independent.requests)
    rows.append({"configuration": f"static DP, independent replicas ({num}xTP-{base}, "
                                  f"simulate())",
                 "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
                 "ttft_mean_s": float(ttft.mean()), "tpot_p50_ms": 1e3 * percentile(tpot, 50),
                 "queue_mean_s": float(np.mean([r.first_scheduled_time - r.arrival_time
                                                for r in independent.requests])),
                 "tok_per_s": out_tokens / independent.makespan_s,
                 "peak_tok_per_s": float("nan"), "binds": 0,
                 "requests_per_mode": "-",
                 "sim_wall_s": wall})
    by = {r["configuration"].split(" (")[0]: r for r in rows}
    ratios = {
        "ttft_p90_tp_over_switching": by["static TP"]["ttft_p90_s"]
        / by["switching"]["ttft_p90_s"],
        "peak_tok_s_switching_over_dp": by["switching"]["peak_tok_per_s"]
        / by["static DP"]["peak_tok_per_s"],
        "tok_s_switching_over_dp": by["switching"]["tok_per_s"] / by["static DP"]["tok_per_s"]}

    # Table 1: a high-priority share binding a group at once (hard preemption), 3-5 req/s.
    trace, priorities = alternating_load_workload(AlternatingLoadSpec(
        num_requests=requests_n, seed=args.seed, low_qps=(3.0, 5.0), burst_qps=(3.0, 5.0),
        high_priority_fraction=args.priority_fraction, high_priority=-1))
    prio_requests = to_requests(trace)
    for r, p in zip(prio_requests, priorities):
        r.priority = p
    prio_runs = {"static TP": run(prio_requests, "off", 1, args.devices),
                 "static DP": run(prio_requests, "off", num, base)}
    # The group a priority request binds: every replica (the node pauses for it) or half
    # of them (the other half keeps serving DP), unless --tp-group names one.
    for m in ((args.tp_group,) if args.tp_group else sorted({num, max(2, num // 2)})):
        prio_runs[f"switching (priority, hard, TP-{m * base})"] = run(
            prio_requests, "priority", num, base, priority_threshold=-1,
            priority_preemption="hard", tp_group_size=m)
    m = args.tp_group or num
    prio_runs[f"switching (priority, hard, TP-{m * base}, max_pause_s 1)"] = run(
        prio_requests, "priority", num, base, priority_threshold=-1,
        priority_preemption="hard", tp_group_size=m, max_pause_s=1.0)
    table1 = []
    for name, (result, coordinator, _) in prio_runs.items():
        high = [r for r in result.requests if r.priority <= -1]
        sh, sa = result.stats(high), result.stats()
        table1.append({"configuration": name, "tpot_mean_ms_priority": 1e3 * sh["tpot_s_mean"],
                       "tpot_mean_ms_all": 1e3 * sa["tpot_s_mean"],
                       "ttft_mean_ms_priority": 1e3 * sh["ttft_s_mean"],
                       "ttft_mean_ms_all": 1e3 * sa["ttft_s_mean"],
                       "peak_tok_per_s": result.peak_throughput_tok_s(),
                       "binds": coordinator.mode_changes.get("bind", 0)})

    # Table 2: the longest request each configuration holds.
    table2 = []
    for k in sorted({base * 2 ** i for i in range(8) if base * 2 ** i <= args.devices}):
        table2.append({"configuration": f"static {args.devices // k}DPx{k}TP",
                       "devices_per_instance": k,
                       "max_context_tokens": kv_capacity_tokens(model, ParallelConfig(tp=k),
                                                                hardware)})
    units = switching_units(model, hardware=hardware, num_replicas=num, base_tp=base,
                            group_sizes=group_sizes, token_buckets=buckets)
    for m in (1,) + group_sizes:
        table2.append({"configuration": f"switching: {m} x TP-{base} bound (TP-{m * base})",
                       "devices_per_instance": m * base,
                       "max_context_tokens": units.replica_kv_tokens if m == 1
                       else units.group_kv_tokens(m)})

    results = {"model": model.name, "hardware": hardware.name, "devices": args.devices,
               "base_tp": base, "requests": requests_n, "seed": args.seed,
               "scheduler": args.scheduler, "switching_config": knobs,
               "predictor": "AnalyticalPredictor", "ttft_throughput": rows, "ratios": ratios,
               "table1_priority": table1, "table2_max_context": table2, "paper": PAPER,
               "context": environment()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    table(f"Simulated ({hardware.name} preset, AnalyticalPredictor, {model.name}, "
          f"{args.devices} devices, {requests_n} requests): Table 2, max context per instance "
          f"(paper: 264K / 959K / 2.3M / switching 1.9M with TP-4 bases)", table2)
    table(f"Simulated: Table 1, {args.priority_fraction:.0%} high-priority requests, "
          f"3-5 req/s (paper: TP 22/22/63/2130 ms 2530 tok/s; DP 32/32/166/166 ms 3164; "
          f"switching 24/28/74/142 ms 3040)", table1)
    table("Simulated ratios (paper: TP/switching TTFT p90 1.66x; switching/DP peak 0.965)",
          [dict(ratios)])
    table(f"Simulated ({hardware.name} preset, AnalyticalPredictor, {model.name}): TTFT and "
          f"throughput under 2-5 <-> 10-30 req/s bursts, {requests_n} requests", rows)
    return results


if __name__ == "__main__":
    main()
