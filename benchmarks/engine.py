"""Engine step benchmark: host overhead per step and tokens/s for decode, prefill and mixed.

    python -m benchmarks.engine [--model smollm2-135m] [--quick] [--json FILE]

Host overhead is the host time on a step's critical path, as `Engine.execute` measures
it: building the padded inputs, transferring and dispatching them, and reading back the
sampled tokens (bookkeeping that overlaps the device is not counted). Beside it: the
whole step, and the same compiled executable called on inputs already on the device.
All are medians over repeated runs of the same batch; the first run of each is excluded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import jax
import numpy as np


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def scenarios(quick: bool) -> dict[str, list[tuple[int, int]]]:
    """name -> chunks as (context before the chunk, chunk tokens)."""
    rng = np.random.default_rng(0)
    decode_batch = 8 if quick else 31      # leaves a seat for the mixed batch's chunk
    decodes = [(int(c), 1) for c in rng.integers(64, 1024, decode_batch)]
    return {
        f"decode x{decode_batch}": decodes,
        "prefill 256": [(0, 256)],
        "prefill 256 @ctx 1024": [(1024, 256)],
        f"mixed {decode_batch} decodes + 128 chunk": decodes + [(512, 128)],
    }


def measure(engine, name: str, chunks: list[tuple[int, int]], rng, repeats: int) -> dict:
    """One scenario's row on `engine`: its batch of `chunks` (context before, chunk tokens)
    built, compiled (as warm-up would) and run `repeats` times; the median whole step, the
    same executable on inputs already on the device, the host time on the critical path,
    and building the inputs alone. One-program engines (spp = 1)."""
    from medha_jax.engine.calibration import borrow_batch, release_batch
    from medha_jax.engine.step_inputs import build_step_inputs

    batch = borrow_batch(engine, chunks, rng)
    try:
        inputs = build_step_inputs(batch, engine.allocator, engine.ladder,
                                   pad_slot=engine.pad_slot)
        engine.warmup(progress=False, shapes=[inputs.padded_shape])   # as the server does
        engine.execute(batch)                                   # first run excluded
        host_times = []

        def execute():
            engine.execute(batch)
            host_times.append(engine.last_host_seconds)

        total = _median_seconds(execute, repeats)
        build = _median_seconds(lambda: build_step_inputs(
            batch, engine.allocator, engine.ladder, pad_slot=engine.pad_slot), repeats)
        executable = engine.executables[inputs.padded_shape]
        args = engine.step_args(inputs)

        def device_only():
            outputs, engine.kv_cache = executable(args[1], engine.kv_cache, *args[3:])
            jax.block_until_ready(outputs)

        device_only()
        device = _median_seconds(device_only, repeats)
    finally:
        release_batch(engine, batch)
    return {
        "scenario": name, "tokens": batch.num_tokens, "padded_shape": list(inputs.padded_shape),
        "step_ms": total * 1e3, "device_ms": device * 1e3,
        "host_overhead_ms": statistics.median(host_times) * 1e3,
        "build_inputs_ms": build * 1e3,
        "tok_per_s": batch.num_tokens / total,
    }


def run(model_name: str, quick: bool, repeats: int):
    from medha_jax import load_model
    from medha_jax.engine import Engine, EngineConfig

    model = load_model(model_name)
    engine = Engine(model, EngineConfig(max_kv_tokens=65_536, max_tokens_per_step=512,
                                        max_seqs=32, max_model_len=2048))
    rng = np.random.default_rng(1)
    rows = [measure(engine, name, chunks, rng, repeats)
            for name, chunks in scenarios(quick).items()]
    return model, rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--quick", action="store_true", help="smaller batches, fewer repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 15)
    model, rows = run(args.model, args.quick, repeats)

    header = f"{'scenario':<32} {'tokens':>6} {'T,S,W':>14} {'step_ms':>9} {'device_ms':>9} " \
             f"{'host_overhead_ms':>16} {'build_inputs_ms':>15} {'tok_per_s':>10}"
    print(f"engine benchmark: model={args.model} backend={jax.default_backend()} "
          f"devices={jax.device_count()} repeats={repeats} (median)")
    print(header)
    for r in rows:
        print(f"{r['scenario']:<32} {r['tokens']:>6} {str(tuple(r['padded_shape'])):>14} "
              f"{r['step_ms']:>9.2f} {r['device_ms']:>9.2f} {r['host_overhead_ms']:>16.3f} "
              f"{r['build_inputs_ms']:>15.3f} {r['tok_per_s']:>10.1f}")
    if args.json:
        context = {
            "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
            "device_count": jax.device_count(), "jax": jax.__version__,
            "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
            "model": args.model, "dtype": model.config.dtype, "mesh": dict(model.mesh.shape),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "repeats": repeats,
        }
        with open(args.json, "w") as f:
            json.dump({"context": context, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
