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
    return p.parse_args(argv)


def percentile(values, q):
    return float(np.percentile(np.asarray(values), q))


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
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


if __name__ == "__main__":
    main()
