"""Engine step benchmark: host overhead per step and tokens/s for decode, prefill and mixed.

    python -m benchmarks.engine [--model smollm2-135m] [--quick] [--json FILE]

Host overhead is the host time on a step's critical path, as `Engine.execute` measures
it: building the padded inputs, transferring and dispatching them, and reading back the
sampled tokens (bookkeeping that overlaps the device is not counted). Beside it: the
whole step, and the same compiled executable called on inputs already on the device.
All are medians over repeated runs of the same batch; the first run of each is excluded.

The last rows time one decode batch of `--cache-model` against KV caches of different
sizes, at tp=1 and at tp = its K/V heads (one K/V head per device, the usual Llama-3
tp=8): a step reads only its sequences' pages, so its time must not grow with the cache
(`vs_small_cache`: device time over the same mesh's at the smallest cache). It grew
before the cache folded its heads axis (issue 25: XLA re-laid out a size-1 heads axis,
copying the whole cache every step).

With --breakdown, each scenario's step is also traced once (jax.profiler) and its device
time split by what the step's XLA ops compute, from each op's source in the compiled HLO
(`op_breakdown`): dense layers, LM head, attention, the layer scan's copies of each layer's
weights, KV cache writes, sampling, and the rest (norms, RoPE, residuals, loop overhead).
The CPU runtime traces every op (thunk) by its HLO name; times are exclusive (a loop's
body is not counted in the loop) and summed over threads.

The rows "decode xN, min_token_bucket B" run decodes of 1, 2, 4 and 8 sequences on engines
whose token ladder starts at 16 (the default until 2026-12) and at 1 (the default since;
`vs_bucket_16`, in the ratio column: the device time over the 16-token step's). A one-token step copied the whole KV cache three
times per layer until the cache write kept a second, dropped row (21 s for one SmolLM2
decode on 2 cores).

The rows "<scenario>, xla path / cpu kernels" run the same decodes (1, 2, 4 and 8), prefill
chunks and mixed batch on the XLA path and with the native CPU kernels
(`pallas_kernels.cpu_native`; `vs_xla_path` in the ratio column), on a CPU where they build.
This module runs 8 virtual CPU devices (for the tp = K rows) unless XLA_FLAGS names a
count, and there the kernels of a one-device engine run slower than in a
process of one device (a lone SmolLM2 decode on 2 cores: 52 against 31 ms; the XLA path's
~50 ms either way); for the figures a one-device server has:
    XLA_FLAGS=--xla_force_host_platform_device_count=1 python -m benchmarks.engine --quick
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time

import numpy as np

# tp = K needs K devices: on the CPU, virtual ones. JAX reads this when its back-end starts.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
import jax  # noqa: E402


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# What a step's ops compute, by the source each op's HLO metadata names (op_name): the
# first category whose words one of appears in it. Loops take their body's category
# (the attention's loops say "ragged_paged_attention"); the layer scan's own loop and the
# ops no word names fall to "other".
BREAKDOWN_CATEGORIES = (
    ("attention", ("attention",)),
    ("KV cache writes", ("scatter",)),
    ("layer weights sliced", ("dynamic_index_in_dim",)),
    ("LM head", ("sd,dv->sv",)),
    ("dense layers", ("dot_general", "layer_matmul")),      # (the native CPU kernel's)
    ("sampling", ("sampl", "top_k", "argmax", "categorical", "log_softmax")),
)
OTHER = "other"
_HLO_OP = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = .*?op_name="([^"]*)"', re.MULTILINE)


def hlo_op_names(hlo_text: str) -> dict[str, str]:
    """Instruction name -> its metadata op_name, over every computation of an HLO module's
    text (`compiled.as_text()`)."""
    return {m.group(1): m.group(2) for m in _HLO_OP.finditer(hlo_text)}


def category_of(op_name: str) -> str:
    return next((name for name, words in BREAKDOWN_CATEGORIES
                 if any(w in op_name for w in words)), OTHER)


def exclusive_seconds(events: list[dict], op_names: dict[str, str]) -> dict[str, float]:
    """Seconds per category of complete trace events ({"name", "ts", "dur", "tid"}, times
    in us) that name HLO instructions, each less the events nested inside it on its thread
    (a loop less its body's ops). Events of other names (the runtime's own) are ignored."""
    totals: dict[str, float] = collections.defaultdict(float)
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("name") in op_names:
            by_thread[e.get("tid")].append(e)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []                     # [end, category, exclusive us]
        for e in thread:
            while stack and stack[-1][0] <= e["ts"]:
                _, category, us = stack.pop()
                totals[category] += us / 1e6
            if stack:
                stack[-1][2] -= e["dur"]
            stack.append([e["ts"] + e["dur"], category_of(op_names[e["name"]]), e["dur"]])
        for _, category, us in stack:
            totals[category] += us / 1e6
    return dict(totals)


def op_breakdown(compiled, call, repeats: int = 2) -> dict[str, float]:
    """ms per step of each category (BREAKDOWN_CATEGORIES, OTHER) while `call()` runs the
    `compiled` executable `repeats` times under jax.profiler (the first call outside it)."""
    op_names = hlo_op_names(compiled.as_text())
    call()
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(repeats):
                call()
        paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
        with gzip.open(paths[0]) as f:
            events = json.load(f)["traceEvents"]
    return {name: seconds * 1e3 / repeats
            for name, seconds in exclusive_seconds(events, op_names).items()}


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


def measure(engine, name: str, chunks: list[tuple[int, int]], rng, repeats: int,
            breakdown: bool = False) -> dict:
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
        parts = op_breakdown(executable, device_only) if breakdown else None
    finally:
        release_batch(engine, batch)
    cache = engine.kv_cache
    return {
        "scenario": name, "model": engine.model.config.name,
        "mesh": f"tp={engine.model.parallel.tp}",
        "kv_cache_mib": (cache.k.nbytes + cache.v.nbytes) / 2**20,
        "tokens": batch.num_tokens, "padded_shape": list(inputs.padded_shape),
        "step_ms": total * 1e3, "device_ms": device * 1e3,
        "host_overhead_ms": statistics.median(host_times) * 1e3,
        "build_inputs_ms": build * 1e3,
        "tok_per_s": batch.num_tokens / total,
        **({"breakdown_ms": parts} if parts is not None else {}),
    }


def run(model_name: str, quick: bool, repeats: int, breakdown: bool = False):
    from medha_jax import load_model
    from medha_jax.engine import Engine, EngineConfig

    model = load_model(model_name)
    engine = Engine(model, EngineConfig(max_kv_tokens=65_536, max_tokens_per_step=512,
                                        max_seqs=32, max_model_len=2048))
    rng = np.random.default_rng(1)
    rows = [measure(engine, name, chunks, rng, repeats, breakdown)
            for name, chunks in scenarios(quick).items()]
    return model, rows


def run_small_token_buckets(model_name: str, repeats: int) -> list[dict]:
    """Decodes of 1, 2, 4 and 8 sequences on engines whose token ladder starts at 16 and
    at 1, side by side: on the CPU a step costs with its padded tokens and sequences even
    this small (`vs_bucket_16`: device time over the 16-token step's)."""
    from medha_jax import load_model
    from medha_jax.engine import Engine, EngineConfig

    model = load_model(model_name, verbose=False)
    rows, padded16 = [], {}
    for min_bucket in (16, 1):
        engine = Engine(model, EngineConfig(max_kv_tokens=16_384, max_tokens_per_step=512,
                                            max_seqs=32, max_model_len=2048,
                                            min_token_bucket=min_bucket))
        for n in (1, 2, 4, 8):
            chunks = [(int(c), 1) for c in np.random.default_rng(n).integers(200, 600, n)]
            row = measure(engine, f"decode x{n}, min_token_bucket {min_bucket}", chunks,
                          np.random.default_rng(1), repeats)
            padded16.setdefault(n, row["device_ms"])
            row["vs_bucket_16"] = row["device_ms"] / padded16[n]
            rows.append(row)
        del engine
    return rows


def run_cpu_kernels(model_name: str, quick: bool, repeats: int) -> list[dict]:
    """Decodes of 1, 2, 4 and 8 sequences, and the prefill and mixed scenarios, on the XLA
    path and with the native CPU kernels (`pallas_kernels.cpu_native`: the decode and the
    chunk attention, the layer matrices read in place, the tied LM head), side by side
    (`vs_xla_path`: device time over the XLA path's). [] off a CPU or where the kernels did
    not build (said)."""
    from unittest import mock

    from medha_jax import load_model
    from medha_jax.engine import Engine, EngineConfig
    from pallas_kernels import cpu_native

    if jax.default_backend() != "cpu" or not cpu_native.available():
        print(f"cpu kernels: not compared ({jax.default_backend()}; {cpu_native.status()})")
        return []
    model = load_model(model_name, verbose=False)
    rows, xla = [], {}
    for native in (False, True):
        # The choice is made when a step is traced: this engine's steps are traced here,
        # not taken from jit's caches (the rows above compiled the same shapes).
        jax.clear_caches()
        with mock.patch.object(cpu_native, "available", lambda: native):
            engine = Engine(model, EngineConfig(max_kv_tokens=16_384, max_tokens_per_step=512,
                                                max_seqs=32, max_model_len=2048))
            cases = {f"decode x{n}": [(int(c), 1) for c in
                                      np.random.default_rng(n).integers(200, 600, n)]
                     for n in (1, 2, 4, 8)}
            cases.update((name, chunks) for name, chunks in scenarios(quick).items()
                         if not name.startswith("decode"))
            for name, chunks in cases.items():
                row = measure(engine, f"{name}, {'cpu kernels' if native else 'xla path'}",
                              chunks, np.random.default_rng(1), repeats)
                xla.setdefault(name, row["device_ms"])
                row["vs_xla_path"] = row["device_ms"] / xla[name]
                rows.append(row)
        del engine
    return rows


# Whole KV caches (K and V, all layers, all devices) the decode batch runs against.
CACHE_SIZES_MIB = (2, 128)


def run_cache_sizes(model_name: str, repeats: int) -> list[dict]:
    """The same decode batch against caches of CACHE_SIZES_MIB, at tp=1 and tp = K/V heads
    (skipped, and said, with fewer devices), side by side. model_name: a preset."""
    from medha_jax import ParallelConfig, load_model
    from medha_jax.config import model_preset
    from medha_jax.engine import Engine, EngineConfig

    config = model_preset(model_name)
    meshes = [ParallelConfig()]
    if config.num_kv_heads > 1:
        if jax.device_count() >= config.num_kv_heads:
            meshes.append(ParallelConfig(tp=config.num_kv_heads))
        else:
            print(f"cache sizes: tp={config.num_kv_heads} needs {config.num_kv_heads} devices, "
                  f"{jax.device_count()} here: tp=1 only")
    page_size, num_decodes, context = 16, 8, 256
    rows = []
    for parallel in meshes:
        model = load_model(model_name, parallel=parallel, verbose=False)
        page_bytes = page_size * model.config.kv_bytes_per_token()     # the dtype loaded
        smallest = None
        for mib in CACHE_SIZES_MIB:
            # The same page tables at every size (max_model_len fixes their width): only
            # the cache grows.
            engine = Engine(model, EngineConfig(page_size=page_size,
                                                num_pages=mib * 2**20 // page_bytes,
                                                max_tokens_per_step=16, max_seqs=num_decodes,
                                                max_model_len=2 * context))
            rng = np.random.default_rng(2)
            row = measure(engine, f"decode x{num_decodes} @ctx {context}",
                          [(context, 1)] * num_decodes, rng, repeats)
            smallest = smallest or row["device_ms"]
            row["vs_small_cache"] = row["device_ms"] / smallest
            rows.append(row)
            del engine                                   # free its cache before the next
    return rows


def print_breakdown(rows: list[dict]) -> None:
    """Each scenario's ops' time by category, ms per step (share of their sum)."""
    names = [name for name, _ in BREAKDOWN_CATEGORIES] + [OTHER]
    print(f"\nstep breakdown, ms per step (share of the ops' time; exclusive, over threads)")
    print(f"{'scenario':<32} " + " ".join(f"{n:>22}" for n in names) + f" {'device_ms':>9}")
    for r in rows:
        parts = r["breakdown_ms"]
        total = sum(parts.values()) or 1.0
        cells = [f"{parts.get(n, 0.0):>14.1f} ({parts.get(n, 0.0) / total:>4.0%})"
                 for n in names]
        print(f"{r['scenario']:<32} " + " ".join(cells) + f" {r['device_ms']:>9.2f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--cache-model", default="tiny",
                        help="preset of the decode step vs cache size rows (tp=1 and tp=K)")
    parser.add_argument("--quick", action="store_true", help="smaller batches, fewer repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--breakdown", action="store_true",
                        help="also split each scenario's device time by what its ops compute")
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 15)
    model, rows = run(args.model, args.quick, repeats, args.breakdown)
    rows += run_small_token_buckets(args.model, repeats)
    rows += run_cpu_kernels(args.model, args.quick, repeats)
    rows += run_cache_sizes(args.cache_model, repeats)

    width = max(len(r["model"]) for r in rows)
    header = f"{'scenario':<42} {'model':<{width}} {'mesh':<5} {'kv_cache_mib':>12} " \
             f"{'tokens':>6} " \
             f"{'T,S,W':>14} {'step_ms':>9} {'device_ms':>9} {'host_overhead_ms':>16} " \
             f"{'build_inputs_ms':>15} {'tok_per_s':>10} {'ratio':>6}"
    print(f"engine benchmark: model={args.model}, cache sizes: {args.cache_model}; "
          f"backend={jax.default_backend()} devices={jax.device_count()} repeats={repeats} "
          f"(median)")
    print(header)
    for r in rows:
        ratio = next((f"{r[k]:.2f}" for k in ("vs_small_cache", "vs_bucket_16", "vs_xla_path")
                      if k in r),
                     "-")
        print(f"{r['scenario']:<42} {r['model']:<{width}} {r['mesh']:<5} "
              f"{r['kv_cache_mib']:>12.1f} "
              f"{r['tokens']:>6} {str(tuple(r['padded_shape'])):>14} "
              f"{r['step_ms']:>9.2f} {r['device_ms']:>9.2f} {r['host_overhead_ms']:>16.3f} "
              f"{r['build_inputs_ms']:>15.3f} {r['tok_per_s']:>10.1f} {ratio:>6}")
    broken_down = [r for r in rows if "breakdown_ms" in r]
    if broken_down:
        print_breakdown(broken_down)
    if args.json:
        context = {
            "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
            "device_count": jax.device_count(), "jax": jax.__version__,
            "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
            "model": args.model, "cache_model": args.cache_model, "dtype": model.config.dtype,
            "mesh": dict(model.mesh.shape),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "repeats": repeats,
        }
        with open(args.json, "w") as f:
            json.dump({"context": context, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
