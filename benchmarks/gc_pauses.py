"""Python's garbage-collector pauses in a serving process, with the start-up heap frozen
(`Server(freeze_gc=True)`, the default; serving.gc_freeze) and without, in one run.

    python -m benchmarks.gc_pauses --quick          # SmolLM2-135M, a small engine; ~3 min
    python -m benchmarks.gc_pauses --json results/gc_pauses.json

Each run is its own process (the collector's generations are the process's), the two
settings alternating for --rounds rounds, against one compilation cache (a first,
unmeasured start fills it, so every measured start loads the same executables). In each:
the Server is built and its background compiles awaited (`Engine.wait_for_warmup`), then
  full_gc_ms:  one full collection (`gc.collect()`) of the ready server's heap, timed: the
               pause an automatic collection of the oldest generation costs while serving
               (every thread stops), and tracked, the objects the collector walks;
  served:      --requests greedy requests of --output-tokens tokens each, submitted at once
               and streamed, while `gc.callbacks` times every automatic collection:
               collections and the longest pause per generation, the pauses' total, TPOT
               p50/p99 and the longest gap between two tokens of one stream.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from benchmarks.report import environment, table
from benchmarks.restart import QUICK_ENGINE


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gc_pauses", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"a small engine ({QUICK_ENGINE}), fewer requests")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=None, help="alternations (default 2; 1)")
    p.add_argument("--requests", type=int, default=None, help="requests per run (16; 8)")
    p.add_argument("--output-tokens", type=int, default=None, help="tokens each (48; 24)")
    p.add_argument("--json", default=None, help="write every run and the context here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)    # one run, as JSON
    return p.parse_args(argv)


def one_run(spec: dict) -> dict:
    """In the child: a ready server's full-collection pause, then a served workload's."""
    import gc

    from medha_jax import SamplingParams
    from medha_jax.engine import EngineConfig
    from serving.server import Server

    with Server(spec["model"], engine_config=EngineConfig(**spec["engine"]),
                cache_dir=spec["cache_dir"], freeze_gc=spec["freeze_gc"]) as server:
        for engine in server._engines:
            engine.wait_for_warmup()
        time.sleep(0.5)                      # the refreeze after the warm-up (its thread)
        tracked = len(gc.get_objects())
        start = time.perf_counter()
        gc.collect()
        full_gc_ms = (time.perf_counter() - start) * 1e3
        if not spec["measure_serving"]:
            return {"full_gc_ms": full_gc_ms}

        pauses: list[tuple[int, float]] = []
        began: list[float] = []

        def timed(phase, info):
            if phase == "start":
                began.append(time.perf_counter())
            elif began:
                pauses.append((info["generation"], (time.perf_counter() - began.pop()) * 1e3))

        params = SamplingParams(temperature=0.0, max_tokens=spec["output_tokens"],
                                ignore_eos=True)
        # Token ids (any model, with or without a tokenizer): 16 to 64 tokens each.
        prompts = [[1 + (7 * i + j) % 250 for j in range(16 * (1 + i % 4))]
                   for i in range(spec["requests"])]
        gaps: list[float] = []

        def read(handle) -> None:          # each stream on its own thread, as clients are
            last = None
            for _ in handle:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now

        gc.callbacks.append(timed)
        try:
            handles = [server.submit(p, params) for p in prompts]
            readers = [threading.Thread(target=read, args=(h,)) for h in handles]
            for reader in readers:
                reader.start()
            for reader in readers:
                reader.join()
            outputs = [handle.result() for handle in handles]
        finally:
            gc.callbacks.remove(timed)
        tpots = sorted(o.metrics.tpot for o in outputs)
        row = {"full_gc_ms": full_gc_ms, "tracked": tracked,
               "frozen": gc.get_freeze_count(),
               "pauses_total_ms": sum(d for _, d in pauses),
               "tpot_p50_ms": statistics.median(tpots) * 1e3,
               "tpot_p99_ms": tpots[round(0.99 * (len(tpots) - 1))] * 1e3,
               "max_token_gap_ms": max(gaps) * 1e3 if gaps else 0.0}
        for generation in (0, 1, 2):
            mine = [d for g, d in pauses if g == generation]
            row[f"gen{generation}_n"] = len(mine)
            row[f"gen{generation}_max_ms"] = max(mine) if mine else 0.0
        return row


def run_child(spec: dict) -> dict:
    done = subprocess.run([sys.executable, "-m", "benchmarks.gc_pauses", "--child",
                           json.dumps(spec)], capture_output=True, text=True, check=False,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if done.returncode:
        raise RuntimeError(f"run {spec} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        print(json.dumps(one_run(json.loads(args.child))))
        return
    rounds = args.rounds or (1 if args.quick else 2)
    base = {"model": args.model, "engine": QUICK_ENGINE if args.quick else {},
            "requests": args.requests or (8 if args.quick else 16),
            "output_tokens": args.output_tokens or (24 if args.quick else 48)}
    with tempfile.TemporaryDirectory() as cache_dir:
        base["cache_dir"] = cache_dir
        run_child({**base, "freeze_gc": True, "measure_serving": False})    # fills the cache
        runs = []
        for r in range(rounds):
            for freeze in ((True, False) if r % 2 == 0 else (False, True)):
                row = run_child({**base, "freeze_gc": freeze, "measure_serving": True})
                runs.append({"freeze_gc": freeze, "round": r, **row})
    columns = ["freeze_gc", "round", "tracked", "frozen", "full_gc_ms", "gen0_n", "gen0_max_ms",
               "gen1_n", "gen1_max_ms", "gen2_n", "gen2_max_ms", "pauses_total_ms",
               "tpot_p50_ms", "tpot_p99_ms", "max_token_gap_ms"]
    table(f"garbage-collector pauses, {args.model}, {base['requests']} requests x "
          f"{base['output_tokens']} tokens, each run its own process",
          [{c: r[c] for c in columns} for r in runs])
    on = [r["full_gc_ms"] for r in runs if r["freeze_gc"]]
    off = [r["full_gc_ms"] for r in runs if not r["freeze_gc"]]
    print(f"a full collection of the ready heap: {statistics.median(off):.1f} ms unfrozen, "
          f"{statistics.median(on):.2f} ms frozen ({statistics.median(off) / max(statistics.median(on), 1e-9):.0f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "spec": {k: v for k, v in base.items() if k != "cache_dir"},
                       "environment": environment()}, f, indent=2)


if __name__ == "__main__":
    main()
