"""Attention kernel benchmark: prefill chunks over long contexts, decode batches, and the
cost of chunking (seed 000, section 3.1 and figure 3b).

    python -m benchmarks.kernels --quick                     # CPU: the XLA path, small sizes
    python -m benchmarks.kernels --json results/kernels.json # GPU: the Pallas kernels, 4K..1M
    python -m benchmarks.kernels --compare                   # also time the XLA path; ratio
    python -m benchmarks.kernels --no-baselines              # skip JAX's own kernels

Three measurements, each on one layer's attention (one sequence's chunk, or a decode batch):

- prefill: one chunk of c tokens at the end of a context of n tokens (causal inside the
  chunk, full over the earlier context), for n in 4K..1M and c in 32..2048. Useful FLOPs are
  4 * head_dim * q_heads * (keys each query attends, summed); MFU divides by the device's
  peak FLOP/s.
- decode: a batch of b sequences, one query each, over n cached tokens; and, ragged, one
  sequence over n among b - 1 over n / 16 (a long request decoding among chats). Bytes
  that must move are the K/V each sequence attends plus q and out; MBU divides by the
  device's HBM bandwidth.
- chunking overhead: the time to prefill a whole n-token prompt in 32-token chunks over the
  time in 2048-token chunks. Estimated, not run in full: chunk steps are timed at a few
  positions spread over the prompt, fitted with t(p) = a + b * p by least squares (a chunk
  step's attention is linear in its position), and the fit is summed over every chunk.

Ours run through the entry point the model calls, `ragged_paged_attention` with the
decode/prefill split: prefill chunks with num_decodes=[0] (the ragged kernel's
prefill-sized query blocks), decode batches with num_decodes=[batch] (the decode path, its
KV splits capped as in the model). Beside them,
where JAX ships a kernel for the device ("baselines", on by default on a GPU or TPU):
GPU decode `jax.experimental.pallas.ops.gpu.paged_attention` (paged) and
`decode_attention.gqa` (contiguous K/V); TPU prefill and decode
`pallas.ops.tpu.ragged_paged_attention`. JAX ships no paged prefill kernel for GPUs. Each
gets its own cache layout, converted outside the timed call; speedup_vs_jax is its time
over ours.

Peaks come from medha_jax.scheduler.hardware (preset picked from the device kind, or
--hardware). On the CPU there is no preset: absolute numbers only, fractions shown as "-".
Times are medians over --repeats runs after a warm-up (compile) run; min and max go to the
JSON. "auto" runs the Pallas kernel on a GPU, the Mosaic kernel on a TPU and the XLA path
on a CPU: on a CPU the figures are the host's jnp path (the kernels only run there in
interpreters, whose timings mean nothing), never a device's.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import statistics
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from medha_jax.config import model_preset
from pallas_kernels import ragged_paged_attention
from pallas_kernels.block_sizes import device_kind_of
from pallas_kernels.dense_reference import random_page_table
from pallas_kernels.dispatch import IMPLS, block_sizes_for, resolve_impl

K = 1024
PAGE_SIZE = 16
# A ragged decode batch: one sequence at the row's context, the others at 1/16 of it.
RAGGED_SHORT_FRACTION = 16
# Device kind substrings -> medha_jax.scheduler.hardware presets.
DEVICE_KIND_PRESETS = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"),
                       ("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("v5p", "tpu-v5p"))


@dataclasses.dataclass(frozen=True)
class Grid:
    contexts: tuple[int, ...]
    chunks: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_batches: tuple[int, ...]
    overhead_context: int
    overhead_positions: int     # chunk steps timed per chunk size for the overhead fit
    max_kv_bytes: float         # skip configurations whose cache would be larger
    overhead_chunks: tuple[int, int] = (32, 2048)   # (small, large) chunk sizes compared


def default_grid(backend: str, quick: bool, memory_bytes: float) -> Grid:
    if backend == "cpu":
        if quick:
            return Grid(contexts=(4 * K,), chunks=(32, 256, 2048), decode_contexts=(2 * K,),
                        decode_batches=(1, 16, 64), overhead_context=4 * K,
                        overhead_positions=5, max_kv_bytes=2e9)
        return Grid(contexts=(4 * K, 16 * K, 64 * K), chunks=(32, 128, 512, 2048),
                    decode_contexts=(4 * K, 16 * K), decode_batches=(1, 16, 64, 256),
                    overhead_context=16 * K, overhead_positions=5, max_kv_bytes=4e9)
    budget = 0.4 * memory_bytes
    if quick:
        return Grid(contexts=(4 * K, 64 * K), chunks=(32, 2048), decode_contexts=(32 * K,),
                    decode_batches=(1, 64), overhead_context=64 * K, overhead_positions=3,
                    max_kv_bytes=budget)
    return Grid(contexts=(4 * K, 16 * K, 64 * K, 256 * K, 1024 * K),
                chunks=(32, 128, 512, 2048), decode_contexts=(4 * K, 32 * K, 128 * K),
                decode_batches=(1, 8, 32, 128, 256), overhead_context=1024 * K,
                overhead_positions=5, max_kv_bytes=budget)


@dataclasses.dataclass(frozen=True)
class Heads:
    q_heads: int
    kv_heads: int
    head_dim: int


# ----------------------------------------------------------------------------------------
# Inputs and timing
# ----------------------------------------------------------------------------------------


def paged_cache(key, heads: Heads, num_tokens: int, dtype):
    """K and V pages holding num_tokens tokens: [pages, PAGE_SIZE, kv_heads, head_dim]."""
    shape = (max(1, math.ceil(num_tokens / PAGE_SIZE)), PAGE_SIZE, heads.kv_heads, heads.head_dim)
    k_key, v_key = jax.random.split(key)
    return (jax.random.normal(k_key, shape, dtype), jax.random.normal(v_key, shape, dtype))


def shuffled_page_table(rng, seqs: int, context: int) -> jax.Array:
    """int32 [seqs, pages]: each sequence's pages scattered over a cache of exactly
    seqs x pages pages, as an allocator leaves them."""
    pages_per_seq = math.ceil(context / PAGE_SIZE)
    return jnp.asarray(random_page_table(rng, [context] * seqs, max_seqs=seqs,
                                         pages_per_seq=pages_per_seq, page_size=PAGE_SIZE,
                                         num_pages=seqs * pages_per_seq))


# One timed sample of a chained run lasts about this long, so the host's part of it (one
# dispatch and one wait for the device) is a small share of the sample.
CHAINED_SAMPLE_S = 0.02
MAX_CHAINED_CALLS = 200


def time_call(fn, args, repeats: int, *, chained: bool | None = None) -> dict:
    """Median, min and max seconds of one call of fn(*args) over `repeats` samples, after a
    warm-up (compile) call.

    On a CPU a sample is one call, blocked. On an accelerator (`chained`, the default off the
    CPU) the host's clock around one blocked call also counts dispatching it and waiting to
    hear that it finished: ~80 us a call on the lent H200 (a tiny jitted add, blocked; 43 us
    when not blocked), 20x what a 4K-token decode's attention moves at 4 TB/s. There a
    sample runs the call `calls` times in one program (a fori_loop whose carry feeds each
    call's first argument from the previous call's output, so no call can be hoisted or
    dropped) and is divided by `calls`, sized to last ~CHAINED_SAMPLE_S."""
    chained = jax.default_backend() != "cpu" if chained is None else chained
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))        # compile + warm-up, excluded
    one_call = time.perf_counter() - start
    calls = 1
    if chained and jnp.issubdtype(jnp.asarray(args[0]).dtype, jnp.floating):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        one_call = time.perf_counter() - start
        calls = int(min(MAX_CHAINED_CALLS, max(2, math.ceil(CHAINED_SAMPLE_S / one_call))))
        run = chained_calls(fn, calls)
        args = (jnp.zeros((), args[0].dtype), *args)
        jax.block_until_ready(run(*args))   # its compile, excluded
    else:
        run = fn
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append((time.perf_counter() - start) / calls)
    return {"time_s": statistics.median(times), "time_min_s": min(times),
            "time_max_s": max(times), "calls_per_sample": calls}


def chained_calls(fn, calls: int):
    """jit of (zero, x, *rest) -> fn(x, *rest) run `calls` times in a row, each call's x
    being the last one's plus zero times the sum of the last output's first leaf. `zero` is
    an argument (0 at run time), so the compiler cannot fold the dependency away; the sum
    and the add cost O(|x| + |out|) per call, far under the call itself."""
    def run(zero, x, *rest):
        def body(_, carry):
            x, _ = carry
            out = fn(x, *rest)
            first = jax.tree.leaves(out)[0]
            return x + (zero * jnp.sum(first)).astype(x.dtype), out
        placeholder = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                                   jax.eval_shape(fn, x, *rest))
        return jax.lax.fori_loop(0, calls, body, (x, placeholder))[1]
    return jax.jit(run)


def kv_bytes(heads: Heads, tokens: int, itemsize: int) -> int:
    return 2 * tokens * heads.kv_heads * heads.head_dim * itemsize


def chunk_flops(heads: Heads, context: int, chunk: int) -> float:
    """Useful FLOPs of a causal chunk at the end of `context` tokens (QK^T and PV)."""
    keys_attended = chunk * (context - chunk) + chunk * (chunk + 1) / 2
    return 4.0 * heads.head_dim * heads.q_heads * keys_attended


# ----------------------------------------------------------------------------------------
# The three measurements
# ----------------------------------------------------------------------------------------


def prefill_step(heads: Heads, dtype, context: int, chunk: int, *, impl: str, key, rng):
    """(fn, args) for one sequence's chunk of `chunk` tokens ending a `context`-token cache."""
    k_pages, v_pages = paged_cache(key, heads, context, dtype)
    q = jax.random.normal(jax.random.fold_in(key, 1), (chunk, heads.q_heads, heads.head_dim), dtype)
    args = (q, k_pages, v_pages, shuffled_page_table(rng, 1, context),
            jnp.array([0, chunk], jnp.int32), jnp.array([context], jnp.int32),
            jnp.array([1], jnp.int32))
    return split_path_fn(heads, impl, num_decodes=0), args


def decode_step(heads: Heads, impl: str, decode_args: tuple):
    """(fn, args) for a decode-only step from `decode_attention`'s arguments (q, k_pages,
    v_pages, page_table, kv_lens): every sequence one query, all of them decodes."""
    q, k_pages, v_pages, page_table, kv_lens = decode_args
    seqs = q.shape[0]
    args = (q, k_pages, v_pages, page_table, jnp.arange(seqs + 1, dtype=jnp.int32), kv_lens,
            jnp.array([seqs], jnp.int32))
    return split_path_fn(heads, impl, num_decodes=seqs), args


@functools.lru_cache(maxsize=None)
def split_path_fn(heads: Heads, impl: str, num_decodes: int):
    """ragged_paged_attention's arguments -> (out, lse) through the decode/prefill split
    with num_decodes leading decodes, passed traced as the model passes it. One jitted
    function per (heads, impl, num_decodes), so the chunking-overhead steps reuse the
    prefill rows' compiles."""
    step = jax.jit(lambda *a: ragged_paged_attention(
        *a[:-1], sm_scale=heads.head_dim ** -0.5, impl=impl, num_decodes=a[-1]))
    decodes = jnp.array([num_decodes], jnp.int32)
    return lambda *args: step(*args, decodes)


# ----------------------------------------------------------------------------------------
# JAX's own kernels, side by side (each in its own cache layout, converted untimed)
# ----------------------------------------------------------------------------------------


def jax_tpu_kv_cache(k_pages, v_pages):
    """JAX's TPU kernel cache: [pages, page_size, 2 * kv_heads, d], K even heads, V odd."""
    pages, page_size, kv_heads, head_dim = k_pages.shape
    return jnp.stack([k_pages, v_pages], axis=3).reshape(pages, page_size, 2 * kv_heads,
                                                         head_dim)


def jax_prefill_baselines(backend: str, heads: Heads) -> dict:
    """name -> (our prefill args -> (fn, args)); none on a GPU (JAX ships no paged prefill)."""
    if backend != "tpu":
        return {}
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as rpa

    def tpu(q, k_pages, v_pages, page_table, cu_q_lens, kv_lens, num_seqs):
        fn = jax.jit(lambda q, kv, kl, pt, cu, ns: rpa(q, kv, kl, pt, cu, ns,
                                                       sm_scale=heads.head_dim ** -0.5))
        return fn, (q, jax_tpu_kv_cache(k_pages, v_pages), kv_lens, page_table, cu_q_lens,
                    num_seqs)
    return {"jax-tpu-ragged": tpu}


def jax_decode_baselines(backend: str, heads: Heads) -> dict:
    """name -> (our decode args -> (fn, args))."""
    sm_scale = heads.head_dim ** -0.5
    if backend == "tpu":
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as rpa

        def tpu(q, k_pages, v_pages, page_table, kv_lens):
            seqs = q.shape[0]
            fn = jax.jit(lambda q, kv, kl, pt, cu, ns: rpa(q, kv, kl, pt, cu, ns,
                                                           sm_scale=sm_scale))
            return fn, (q, jax_tpu_kv_cache(k_pages, v_pages), kv_lens, page_table,
                        jnp.arange(seqs + 1, dtype=jnp.int32), jnp.array([seqs], jnp.int32))
        return {"jax-tpu-ragged": tpu}
    if backend not in ("gpu", "cuda", "rocm"):
        return {}
    from jax.experimental.pallas.ops.gpu import decode_attention, paged_attention

    def paged(q, k_pages, v_pages, page_table, kv_lens):
        # Its kernel takes unscaled q (no sm_scale argument): scale q, untimed.
        fn = jax.jit(lambda q, k, v, pt, kl: paged_attention.paged_attention(q, k, v, pt, kl))
        return fn, ((q * sm_scale).astype(q.dtype), k_pages.transpose(2, 0, 1, 3),
                    v_pages.transpose(2, 0, 1, 3), page_table, kv_lens)

    def contiguous(q, k_pages, v_pages, page_table, kv_lens):
        seqs = q.shape[0]
        gather = lambda pages: pages[page_table].reshape(seqs, -1, *pages.shape[2:])
        fn = jax.jit(lambda q, k, v, kl: decode_attention.gqa(q, k, v, kv_seq_len=kl,
                                                              sm_scale=sm_scale))
        return fn, (q, gather(k_pages), gather(v_pages), kv_lens)
    return {"jax-gpu-paged": paged, "jax-gpu-gqa-contiguous": contiguous}


def time_baselines(row: dict, baselines: dict, ours: tuple, repeats: int, log) -> None:
    """Times each baseline on our inputs into row[name]; a failure is logged, not fatal
    (a shipped kernel may not support a shape), and recorded as {"error": ...}."""
    for name, make in baselines.items():
        try:
            fn, args = make(*ours)
            row[name] = time_call(fn, args, repeats)
        except Exception as e:  # noqa: BLE001 - reported in the table and JSON
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            log(f"  {name}: {row[name]['error']}")


def run_prefill(heads, dtype, grid: Grid, impls, repeats, key, rng, log,
                baselines=None) -> list[dict]:
    itemsize = jnp.dtype(dtype).itemsize
    rows = []
    for context in grid.contexts:
        if kv_bytes(heads, context, itemsize) > grid.max_kv_bytes:
            log(f"skip prefill context={context}: cache over {grid.max_kv_bytes:.3g} bytes")
            continue
        for chunk in grid.chunks:
            if chunk > context:
                continue
            row = {"kind": "prefill", "context": context, "chunk": chunk, "batch": 1,
                   "flops": chunk_flops(heads, context, chunk),
                   "bytes": kv_bytes(heads, context, itemsize)
                   + 2 * chunk * heads.q_heads * heads.head_dim * itemsize}
            for impl in impls:
                fn, args = prefill_step(heads, dtype, context, chunk, impl=impl, key=key, rng=rng)
                row[impl] = time_call(fn, args, repeats)
            time_baselines(row, baselines or {}, args, repeats, log)
            del fn, args
            rows.append(row)
            log(f"prefill context={context} chunk={chunk}: "
                f"{row[impls[0]]['time_s'] * 1e3:.3f} ms")
    return rows


def run_decode(heads, dtype, grid: Grid, impls, repeats, key, rng, log,
               baselines=None) -> list[dict]:
    itemsize = jnp.dtype(dtype).itemsize
    rows = []
    for context in grid.decode_contexts:
        for batch in grid.decode_batches:
            cache_bytes = kv_bytes(heads, batch * context, itemsize)
            if cache_bytes > grid.max_kv_bytes:
                log(f"skip decode context={context} batch={batch}: cache over "
                    f"{grid.max_kv_bytes:.3g} bytes")
                continue
            k_pages, v_pages = paged_cache(key, heads, batch * context, dtype)
            q = jax.random.normal(jax.random.fold_in(key, 2),
                                  (batch, heads.q_heads, heads.head_dim), dtype)
            page_table = shuffled_page_table(rng, batch, context)
            # Uniform, then (batch > 1) ragged: one long request decoding among chats.
            shapes = [[context] * batch]
            if batch > 1:
                shapes.append([context] + [context // RAGGED_SHORT_FRACTION] * (batch - 1))
            for kv_lens in shapes:
                ragged = len(set(kv_lens)) > 1
                decode_args = (q, k_pages, v_pages, page_table, jnp.asarray(kv_lens, jnp.int32))
                keys = sum(kv_lens)
                row = {"kind": "decode", "context": context, "chunk": 1, "batch": batch,
                       "ragged": ragged,
                       "flops": 4.0 * heads.head_dim * heads.q_heads * keys,
                       "bytes": kv_bytes(heads, keys, itemsize)
                       + 2 * batch * heads.q_heads * heads.head_dim * itemsize}
                for impl in impls:
                    fn, args = decode_step(heads, impl, decode_args)
                    row[impl] = time_call(fn, args, repeats)
                if not ragged:          # JAX's kernels: the uniform batches only
                    time_baselines(row, baselines or {}, decode_args, repeats, log)
                rows.append(row)
                log(f"{decode_name(row)}: {row[impls[0]]['time_s'] * 1e3:.3f} ms")
            del k_pages, v_pages, decode_args, args
    return rows


def decode_name(row: dict) -> str:
    ragged = f" ragged (others ctx/{RAGGED_SHORT_FRACTION})" if row.get("ragged") else ""
    return f"decode ctx={row['context']} batch={row['batch']}{ragged}"


def run_chunking_overhead(heads, dtype, grid: Grid, impl, repeats, key, rng, log) -> dict:
    """Whole-prompt time in small vs large chunks, from a linear fit of sampled chunk steps."""
    n, chunk_sizes = grid.overhead_context, grid.overhead_chunks
    if kv_bytes(heads, n, jnp.dtype(dtype).itemsize) > grid.max_kv_bytes:
        log(f"skip chunking overhead at context={n}: cache too large")
        return {}
    k_pages, v_pages = paged_cache(key, heads, n, dtype)
    page_table = shuffled_page_table(rng, 1, n)
    result = {"context": n, "method": "sampled chunk steps, least-squares t(p) = a + b p, "
                                      "summed over all chunks"}
    for chunk in chunk_sizes:
        q = jax.random.normal(jax.random.fold_in(key, chunk),
                              (chunk, heads.q_heads, heads.head_dim), dtype)
        fn = split_path_fn(heads, impl, num_decodes=0)
        starts = sorted({int(p) // chunk * chunk
                         for p in np.linspace(0, n - chunk, grid.overhead_positions)})
        samples = []
        for start in starts:
            args = (q, k_pages, v_pages, page_table, jnp.array([0, chunk], jnp.int32),
                    jnp.array([start + chunk], jnp.int32), jnp.array([1], jnp.int32))
            samples.append(time_call(fn, args, repeats)["time_s"])
        positions = np.asarray(starts, np.float64)
        if len(starts) > 1:
            slope, intercept = np.polyfit(positions, samples, 1)
        else:
            slope, intercept = 0.0, samples[0]
        all_starts = np.arange(0, n, chunk, dtype=np.float64)
        total = float(np.sum(intercept + slope * all_starts))
        result[f"chunk_{chunk}"] = {"positions": starts, "step_times_s": samples,
                                    "fit_intercept_s": float(intercept),
                                    "fit_slope_s_per_token": float(slope),
                                    "steps": len(all_starts), "total_s": total}
        log(f"chunking overhead: {len(all_starts)} chunks of {chunk}: {total:.4f} s (fit)")
    small, large = chunk_sizes
    result["ratio"] = result[f"chunk_{small}"]["total_s"] / result[f"chunk_{large}"]["total_s"]
    return result


# ----------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------


def hardware_for(device_kind: str, name: str | None):
    """The HardwareSpec of --hardware, or guessed from the device kind; None on a CPU."""
    from medha_jax.scheduler.hardware import hardware_preset
    if name:
        return hardware_preset(name)
    for fragment, preset in DEVICE_KIND_PRESETS:
        if fragment.lower() in device_kind.lower():
            return hardware_preset(preset)
    return None


def summarize(rows: list[dict], impl: str, hardware, compare: str | None,
              baseline_names=()) -> dict[str, dict]:
    table = {}
    for row in rows:
        t = row[impl]["time_s"]
        if row["kind"] == "prefill":
            name = f"prefill ctx={row['context']} chunk={row['chunk']}"
        else:
            name = decode_name(row)
        entry = {"time_ms": t * 1e3, "tflop_per_s": row["flops"] / t / 1e12,
                 "gb_per_s": row["bytes"] / t / 1e9,
                 "mfu": (row["flops"] / t / hardware.peak_flops
                         if hardware and row["kind"] == "prefill" else None),
                 "mbu": (row["bytes"] / t / hardware.hbm_bandwidth
                         if hardware and row["kind"] == "decode" else None)}
        if compare:
            entry["speedup_vs_" + compare] = row[compare]["time_s"] / t
        # The best JAX-shipped kernel that ran on this row; "-" where none applies.
        shipped = [(row[b]["time_s"], b) for b in baseline_names if "time_s" in row.get(b, {})]
        if baseline_names:
            entry["speedup_vs_jax"] = min(shipped)[0] / t if shipped else None
            entry["jax_kernel"] = min(shipped)[1] if shipped else None
        table[name] = entry
    return table


def environment(heads: Heads, model: str, dtype, impl: str, hardware) -> dict:
    import jaxlib
    device = jax.devices()[0]
    head_dim = heads.head_dim
    tiles = block_sizes_for(impl, device_kind_of(device), head_dim, PAGE_SIZE)
    return {"backend": jax.default_backend(), "device_kind": device.device_kind,
            "device_count": jax.device_count(), "mesh_shape": "1 device (one layer, unsharded)",
            "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "python": platform.python_version(), "model": model, "heads": dataclasses.asdict(heads),
            "dtype": jnp.dtype(dtype).name, "page_size": PAGE_SIZE, "impl": impl,
            "block_sizes": dataclasses.asdict(tiles),
            "hardware_preset": hardware.name if hardware else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def cpu_notice(impl: str, hardware) -> str:
    what = {"xla": "the XLA path (plain jnp) on the host CPU"}.get(
        impl, f"impl {impl!r} on the host CPU (an interpreter: its times are not a device's)")
    fractions = ("no device peaks, so MFU/MBU are '-'" if hardware is None else
                 f"MFU/MBU are against {hardware.name}'s peaks, not this host's")
    return (f"CPU run: measured {what}, not a GPU or TPU kernel; {fractions}. Run on the "
            "device for the kernels' figures.")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small grid (about a minute on a CPU)")
    p.add_argument("--json", default=None, help="write every figure and the context here")
    p.add_argument("--model", default=None,
                   help="model preset for the head shapes (default: llama3-70b on an "
                        "accelerator, Medha's model; smollm2-135m on the CPU)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: benchmark one device's share of the heads")
    p.add_argument("--dtype", default=None,
                   help="bfloat16 | float32 (default: bfloat16 on an accelerator, float32 on CPU)")
    p.add_argument("--impl", default="auto", choices=IMPLS)
    p.add_argument("--compare", action="store_true",
                   help="also time the XLA path on the same inputs and report the speedup")
    p.add_argument("--hardware", default=None,
                   help="medha_jax.scheduler.hardware preset for the peaks (default: from the "
                        "device kind; none on a CPU)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per configuration")
    p.add_argument("--no-overhead", action="store_true", help="skip the chunking-overhead fit")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip JAX's own kernels (timed by default on a GPU or TPU)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    backend = jax.default_backend()
    on_cpu = backend == "cpu"
    model = args.model or ("smollm2-135m" if on_cpu else "llama3-70b")
    config = model_preset(model)
    if config.num_kv_heads % args.tp:
        raise SystemExit(f"--tp={args.tp} must divide num_kv_heads={config.num_kv_heads}")
    heads = Heads(config.num_heads // args.tp, config.num_kv_heads // args.tp, config.head_dim)
    dtype = jnp.dtype(args.dtype or ("float32" if on_cpu else "bfloat16"))
    impl = resolve_impl(args.impl, backend)
    impls = [impl] + (["xla"] if args.compare and impl != "xla" else [])
    compare = impls[1] if len(impls) > 1 else None
    repeats = args.repeats or 5
    device = jax.devices()[0]
    hardware = None if on_cpu and not args.hardware else hardware_for(device.device_kind,
                                                                      args.hardware)
    memory = getattr(hardware, "memory_bytes", 16e9)
    grid = default_grid(backend, args.quick, memory)
    key, rng = jax.random.key(0), np.random.default_rng(0)
    log = lambda msg: print(msg, flush=True)
    log(f"{backend} ({device.device_kind}); model {model} heads {heads}; {dtype.name}; "
        f"impl {impls}; peaks from {hardware.name if hardware else 'none (absolute numbers only)'}")
    if on_cpu:
        log(cpu_notice(impl, hardware))
    prefill_baselines = {} if args.no_baselines else jax_prefill_baselines(backend, heads)
    decode_baselines = {} if args.no_baselines else jax_decode_baselines(backend, heads)

    rows = run_prefill(heads, dtype, grid, impls, repeats, key, rng, log, prefill_baselines)
    rows += run_decode(heads, dtype, grid, impls, repeats, key, rng, log, decode_baselines)
    overhead = ({} if args.no_overhead else
                run_chunking_overhead(heads, dtype, grid, impl, repeats, key, rng, log))
    baseline_names = tuple(dict.fromkeys([*prefill_baselines, *decode_baselines]))
    table = summarize(rows, impl, hardware, compare, baseline_names)
    report = {"context": environment(heads, model, dtype, impl, hardware), "rows": rows,
              "table": table, "chunking_overhead": overhead}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)

    from medha_jax.latency_report import format_table
    columns = [("time_ms", "time_ms"), ("tflop_per_s", "tflop_per_s"),
               ("gb_per_s", "gb_per_s"), ("mfu", "mfu"), ("mbu", "mbu")]
    if compare:
        columns.append(("speedup_vs_" + compare, "speedup_vs_" + compare))
    if baseline_names:
        columns += [("speedup_vs_jax", "speedup_vs_jax"), ("jax_kernel", "jax_kernel")]
    if on_cpu:
        print("\n" + cpu_notice(impl, hardware))
    if overhead:
        small, large = grid.overhead_chunks
        print(f"\nchunking overhead at context {overhead['context']}: {small}-token chunks "
              f"take {overhead['ratio']:.3f}x the time of {large}-token chunks "
              f"({overhead['method']})")
    print()
    print(format_table(table, label=f"{impl} ({backend})", columns=columns))
    return report


if __name__ == "__main__":
    main()
