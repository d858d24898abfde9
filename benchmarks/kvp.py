"""KV-cache parallelism (KVP, seed 000 section 3.3, figure 7, appendix B.2): decode latency.

    python -m benchmarks.kvp --quick                 # about a minute on a 2-core CPU
    python -m benchmarks.kvp --json results/kvp.json

Three parts, three tables, the measured one last:

(a) simulated: the decode time per token of one request against its context (128K to 10M)
    for kvp = 1, 2, 4, 8 at tp = 8, Llama-3 8B and 70B on the H100 preset, from
    `AnalyticalPredictor` with every KV shard filled (kv_tokens_per_shard = context / kvp).
    Positions past the models' window are priced as if the window were longer: a cost model.
(b) measured on this machine (virtual CPU devices, tiny model): the bytes every collective of
    the compiled decode step returns, per step (layer loops counted), at kvp = 1, 2, 4 for
    two cache sizes. KVP must not move the cache: the figure must not grow with it.
(c) measured: decode step time of 4 requests at kvp = 1 and 4 with the same KV tokens per
    device (so kvp = 4 serves 4x the context), side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence

from benchmarks.report import environment, table

K = 1024
M = 1024 * 1024


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kvp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer sizes; about a minute on a CPU")
    p.add_argument("--json", default=None, help="write every figure and the context here")
    p.add_argument("--hardware", default="h100", help="hardware preset of the simulation")
    p.add_argument("--tp", type=int, default=8, help="tensor parallelism of the simulation")
    p.add_argument("--repeats", type=int, default=10, help="timed decode steps per config")
    return p.parse_args(argv)


def simulated(args) -> list[dict]:
    from medha_jax.config import ParallelConfig, model_preset
    from medha_jax.scheduler import AnalyticalPredictor
    from medha_jax.scheduler.predictor import BatchFeatures

    contexts = [128 * K, 1 * M, 10 * M] if args.quick else \
        [128 * K, 512 * K, 1 * M, 2 * M, 4 * M, 10 * M]
    rows = []
    for name in ("llama3-8b", "llama3-70b"):
        config = model_preset(name)
        for context in contexts:
            decode = BatchFeatures().plus_chunk(1, context - 1, True)
            row = {"model": name, "context": f"{context // K}K"}
            base = None
            for kvp in (1, 2, 4, 8):
                predictor = AnalyticalPredictor(
                    config, ParallelConfig(tp=args.tp, kvp=kvp), args.hardware,
                    kv_tokens_per_shard=-(-context // kvp))
                tpot = predictor.predict_features(decode)
                base = base or tpot
                row[f"tpot_kvp{kvp}_ms"] = 1e3 * tpot
            for kvp in (2, 4, 8):
                row[f"kvp{kvp}_vs_1"] = row[f"tpot_kvp{kvp}_ms"] / row["tpot_kvp1_ms"]
            rows.append(row)
    return rows


def kvp_engine(kvp: int, pages_per_shard: int, tokens_per_shard: int | None = None):
    from medha_jax import ParallelConfig, load_model
    from medha_jax.engine import Engine, EngineConfig

    model = load_model("tiny", parallel=ParallelConfig(kvp=kvp), verbose=False)
    return Engine(model, EngineConfig(page_size=16, num_pages=pages_per_shard,
                                      max_tokens_per_step=64, max_seqs=8,
                                      max_tokens_per_kvp_group=tokens_per_shard,
                                      enable_prefix_caching=False))


def measured_bytes() -> list[dict]:
    from medha_jax import hlo

    rows = []
    for kvp in (1, 2, 4):
        row = {"kvp": kvp}
        for pages in (64, 1024):
            engine = kvp_engine(kvp, pages)
            shape = (16, 8, engine.ladder.width_buckets[-1])
            text = engine.executable(shape).as_text()
            row[f"cache_tokens_per_device_{pages * 16}"] = pages * 16
            row[f"collective_bytes_per_step_{pages * 16}"] = hlo.bytes_per_call(text)
        rows.append(row)
    return rows


def measured_time(args) -> list[dict]:
    import numpy as np

    from medha_jax.engine.calibration import borrow_batch, release_batch

    tokens_per_device, requests = 1024, 4
    rows = []
    for kvp in (1, 4):
        engine = kvp_engine(kvp, tokens_per_device // 16, tokens_per_shard=tokens_per_device // 4)
        context = kvp * tokens_per_device // requests - 16     # fills each device alike
        rng = np.random.default_rng(0)
        batch = borrow_batch(engine, [(context - 1, 1)] * requests, rng)
        try:
            engine.execute(batch)                            # compile + first touch
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                engine.execute(batch)
                times.append(time.perf_counter() - start)
        finally:
            release_batch(engine, batch)
        rows.append({"kvp": kvp, "requests": requests, "context_tokens": context,
                     "kv_tokens_per_device": requests * context // kvp,
                     "step_ms_median": 1e3 * statistics.median(times),
                     "step_ms_min": 1e3 * min(times), "step_ms_max": 1e3 * max(times)})
    rows[1]["time_vs_kvp1"] = rows[1]["step_ms_median"] / rows[0]["step_ms_median"]
    rows[0]["time_vs_kvp1"] = 1.0
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    import jax

    sim = simulated(args)
    table(f"(a) simulated decode time per token, {args.hardware} preset, tp={args.tp}, "
          "AnalyticalPredictor (every KV shard filled)", sim)
    moved = measured_bytes()
    table(f"(b) measured: collective bytes per decode step ({jax.default_backend()}, "
          "tiny model, 8 sequences)", moved)
    timed = measured_time(args)
    table(f"(c) measured: decode step time, same KV tokens per device "
          f"({jax.default_backend()}, tiny model)", timed)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        context = {**environment(), "model_simulated": "llama3-8b, llama3-70b",
                   "model_measured": "tiny", "dtype": "float32 (measured), bfloat16 (simulated)"}
        with open(args.json, "w") as f:
            json.dump({"context": context, "simulated": sim, "collective_bytes": moved,
                       "decode_time": timed}, f, indent=2)


if __name__ == "__main__":
    main()
