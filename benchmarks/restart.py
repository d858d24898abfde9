"""Start-up time of a Server, first start (empty cache) against second (same config, same
machine, the cache the first one filled), in one run.

    python -m benchmarks.restart --quick      # SmolLM2-135M, a small engine; ~2 min on 2 cores
    python -m benchmarks.restart              # SmolLM2-135M, the default EngineConfig
    python -m benchmarks.restart --json results/restart.json
    python -m benchmarks.restart --engine '{"min_token_bucket": 1}'   # EngineConfig fields

Each start is its own process (as a restarted server is): `Server(model, engine_config=...)`
from the model's name to ready, then one greedy request; the child reports the Server's
StartupReport (compilation-cache hits and misses, where the predictor came from), the time
to construct it, and when every step shape was compiled (a Server warms up in the
background: it is ready once a short request's shapes are, and a step that needs another before
the background thread got to it compiles it then; `waited` counts those). The cache directory is a fresh temporary one unless --cache-dir is
given, so the first start is cold. The two outputs are compared: the cached executables must
give the same tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

QUICK_ENGINE = {"max_kv_tokens": 4096, "max_model_len": 1024, "max_tokens_per_step": 64,
                "max_seqs": 8}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.restart", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"a small engine ({QUICK_ENGINE}); default: EngineConfig()")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--cache-dir", default=None,
                   help="cache to start against (default: a new temporary directory)")
    p.add_argument("--json", default=None, help="write both starts and the context here")
    p.add_argument("--engine", default=None, metavar="JSON",
                   help='EngineConfig fields over the chosen ones, e.g. \'{"min_token_bucket": 1}\'')
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)   # one start, as JSON
    return p.parse_args(argv)


def one_start(spec: dict) -> dict:
    """In the child: build the Server, serve one request, report."""
    start = time.perf_counter()
    from medha_jax import SamplingParams
    from medha_jax.engine import EngineConfig
    from serving.server import Server

    imported = time.perf_counter() - start
    with Server(spec["model"], engine_config=EngineConfig(**spec["engine"]),
                cache_dir=spec["cache_dir"]) as server:
        ready = time.perf_counter() - start
        out = server.generate("The capital of France is",
                              SamplingParams(temperature=0.0, max_tokens=8))
        first_request = time.perf_counter() - start - ready
        engine = server.engine
        if hasattr(engine, "wait_for_warmup"):
            engine.wait_for_warmup()
        all_compiled = time.perf_counter() - start
        report = dataclasses.asdict(server.startup)
        waited = getattr(engine, "compiles_waited_for", 0)
    return {**report, "import_s": imported, "process_ready_s": ready,
            "first_request_s": first_request, "all_compiled_s": all_compiled,
            "compiles_waited_for": waited, "num_executables": engine.num_executables,
            "token_ids": list(out.token_ids)}


def run_start(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.restart", "--child",
                           json.dumps(spec)], capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"a start failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def print_table(starts: list[dict]) -> None:
    columns = [("start", 8), ("ready_s", 9), ("server_init_s", 14), ("exes_loaded", 12),
               ("exes_compiled", 14), ("compile_s_saved", 16), ("predictor", 10),
               ("first_request_s", 16), ("all_compiled_s", 15), ("waited", 7)]
    print("".join(name.rjust(width) for name, width in columns))
    for name, s in zip(("first", "second"), starts):
        values = [name, f"{s['process_ready_s']:.1f}", f"{s['ready_seconds']:.1f}",
                  str(s["executables_loaded"]), str(s["executables_compiled_and_saved"]),
                  f"{s['compile_seconds_saved']:.1f}",
                  s["predictor"].split()[0],
                  f"{s['first_request_s']:.2f}", f"{s['all_compiled_s']:.1f}",
                  str(s["compiles_waited_for"])]
        print("".join(v.rjust(width) for v, (_, width) in zip(values, columns)))


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(one_start(json.loads(args.child))))
        return {}
    with tempfile.TemporaryDirectory(prefix="medha-restart-") as tmp:
        engine = {**(QUICK_ENGINE if args.quick else {}), **json.loads(args.engine or "{}")}
        spec = {"model": args.model, "engine": engine, "cache_dir": args.cache_dir or tmp}
        starts = [run_start(spec), run_start(spec)]
    if starts[0]["token_ids"] != starts[1]["token_ids"]:
        raise RuntimeError(f"the second start's tokens differ: {starts[0]['token_ids']} vs "
                           f"{starts[1]['token_ids']}")
    import jax
    report = {"context": {"jax": jax.__version__, "cpu_count": os.cpu_count(),
                          "args": vars(args), "engine": spec["engine"]},
              "starts": [{k: v for k, v in s.items() if k != "token_ids"} for s in starts]}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(f"{args.model}, engine {spec['engine'] or 'EngineConfig()'}: ready_s is the child "
          "process's time from start to a ready Server (imports and model load included)")
    print_table(starts)
    return report


if __name__ == "__main__":
    main()
