"""GPU readiness in one command: every GPU kernel against its reference, the engine's
greedy tokens against the CPU's, the kernel table and a decode-step breakdown.

    make gpu-check                              # on a GPU host: a few minutes, JSON in results/
    python -m benchmarks.gpu_check --json FILE  # the same
    python -m benchmarks.gpu_check --quick      # on a CPU: the kernel in Pallas interpret mode

Six parts, each on the default back-end's first device with the attention implementation
the engine serves with there ("pallas" on a GPU; on a CPU "interpret", the same kernel in
Pallas interpret mode, so the script runs anywhere and cannot rot):

1. kernels: the GPU kernels (`pallas_kernels.paged_kernel`: the ragged kernel's prefill
   path, its decode path, and a mixed batch, through the entry point the model calls, plus
   `decode_attention`) against the float64 dense oracle on fresh random inputs (a new seed
   each run, printed and in the JSON; --seed repeats one), in float32 and bfloat16.
2. tokens: the tiny model's greedy tokens from the engine on this device against an engine
   on the CPU back-end (the XLA path, float32) with the same weights and prompts: long
   prompts are chunked, so prefill chunks over a cache and decodes both run.
3. the kernel table of `benchmarks.kernels` (MFU for prefill, MBU for decodes, the chunking
   overhead): its full grid, or with --quick its quick one.
4. a decode step of an engine broken down: the whole step, the device alone, the host on
   the critical path (building inputs, dispatch, reading tokens back), and attention (the
   decode kernel timed alone at the step's shapes, times the layers) against the rest of
   the device time (matmuls, norms, sampling); and when `Engine.dispatch` returned (near
   the whole step where the program makes the host wait for the device). Each part runs on
   its own: one that raises fails the run, not the parts after it.
5. on a GPU (or with --step-variants), that breakdown again under each of STEP_VARIANTS'
   XLA flags, one child process each, to see what moves the device time and the dispatch.
6. on a GPU (or with --split-sweep), the decode path at each KV-split count, at a few
   contexts and batches: its time, and its output against one split's.

On a CPU the times are an interpreter's and mean nothing; the checks are what count there.
The exit status is 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
import traceback
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import engine as engine_bench
from benchmarks import kernels
from benchmarks.report import environment
from pallas_kernels import decode_attention, ragged_paged_attention
from pallas_kernels.dense_reference import dense_attention_oracle, random_page_table
from pallas_kernels.block_sizes import device_kind_of
from pallas_kernels.dispatch import GPU_BACKENDS, block_sizes_for

# Each case: (name, q_lens, contexts before the queries, num_decodes or None for the
# `decode_attention` entry point). Decodes come first, as the engine orders them.
KERNEL_CASES = (
    ("prefill", (37, 5, 64), (100, 0, 300), 0),
    ("decode", (1,) * 6, (5, 700, 33, 0, 260, 129), 6),
    ("mixed", (1, 1, 1, 40, 17), (400, 3, 90, 61, 0), 3),
    ("decode_attention", (1,) * 4, (15, 300, 64, 1), None),
)
# Max |error| allowed against the float64 oracle: float32 inputs (a GPU's float32 dots
# may run as TF32), and inputs rounded to bfloat16 (the oracle gets the same rounded values).
TOLERANCE = {("gpu", "float32"): 1e-2, ("cpu", "float32"): 1e-4,
             ("gpu", "bfloat16"): 3e-2, ("cpu", "bfloat16"): 3e-2}
PAGE_SIZE = kernels.PAGE_SIZE

# XLA flags the decode-step breakdown is run again under, each in a child process (XLA reads
# XLA_FLAGS once, at start), to see what moves the step's device time and its dispatch.
# docs/gpu/README.md: on the H200 the matmuls took 3x their weights' read time, and a dynamic
# slice of the stacked layer weights that feeds a GEMM is copied unless XLA fuses it. On a
# CPU the variant is the default spelled out, so the machinery runs where the tests run.
STEP_VARIANTS = {
    "gpu": {"as served": "",
            "dynamic-slice fusion": "--xla_gpu_enable_dynamic_slice_fusion=true"},
    "cpu": {"as served": "", "fast math off (the default)": "--xla_cpu_enable_fast_math=false"},
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run checks and times."""

    impl: str
    heads: kernels.Heads              # the kernel checks' head shapes
    table_heads: kernels.Heads        # the kernel table's
    table_dtype: str
    grid: kernels.Grid
    max_new_tokens: int
    breakdown_model: str              # preset of the decode-step breakdown
    breakdown_decodes: int
    repeats: int
    # The decode KV-split sweep (`split_sweep`): contexts x batches, each at every count.
    sweep_contexts: tuple[int, ...] = ()
    sweep_batches: tuple[int, ...] = ()
    sweep_splits: tuple[int, ...] = ()


def plan_for(backend: str, quick: bool, memory_bytes: float) -> Plan:
    if backend in GPU_BACKENDS:
        llama8b = kernels.Heads(32, 8, 128)
        return Plan(impl="pallas", heads=kernels.Heads(8, 2, 128), table_heads=llama8b,
                    table_dtype="bfloat16", grid=kernels.default_grid(backend, quick, memory_bytes),
                    max_new_tokens=8 if quick else 24,
                    breakdown_model="tiny" if quick else "llama3-8b",
                    breakdown_decodes=32, repeats=3 if quick else 10,
                    sweep_contexts=(32 * 1024,) if quick else (4 * 1024, 32 * 1024, 128 * 1024),
                    sweep_batches=(1, 8), sweep_splits=(1, 4, 8, 16, 32, 64))
    # The interpreter runs the kernel's program instance by instance in Python: small shapes.
    return Plan(impl="interpret", heads=kernels.Heads(4, 2, 32), table_heads=kernels.Heads(4, 2, 32),
                table_dtype="float32",
                grid=kernels.Grid(contexts=(256,), chunks=(32,), decode_contexts=(128,),
                                  decode_batches=(2,), overhead_context=256,
                                  overhead_positions=2, max_kv_bytes=1e9,
                                  overhead_chunks=(32, 64)),
                max_new_tokens=4, breakdown_model="tiny", breakdown_decodes=4, repeats=1,
                sweep_contexts=(128,), sweep_batches=(1,), sweep_splits=(1, 4))


# ----------------------------------------------------------------------------------------
# 1. Kernels against the oracle
# ----------------------------------------------------------------------------------------


def kernel_case(rng, heads: kernels.Heads, q_lens, contexts, dtype) -> dict:
    """Numpy arguments of `ragged_paged_attention` (causal: each sequence's queries are the
    last q_len of its kv_len keys), padded by 3 tokens and one sequence, with q and the
    cache rounded to `dtype` (returned as float32 for the oracle)."""
    kv_lens = [c + n for c, n in zip(contexts, q_lens)]
    pages_per_seq = max(-(-n // PAGE_SIZE) for n in kv_lens)
    max_seqs = len(q_lens) + 1
    num_pages = max_seqs * pages_per_seq + 3
    tokens = sum(q_lens) + 3
    cu_q_lens = np.full(max_seqs + 1, sum(q_lens), np.int32)
    cu_q_lens[:len(q_lens) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv = np.zeros(max_seqs, np.int32)
    kv[:len(q_lens)] = kv_lens
    cache = (num_pages, PAGE_SIZE, heads.kv_heads, heads.head_dim)
    rounded = lambda x: np.asarray(jnp.asarray(x, dtype), np.float32)  # noqa: E731
    return dict(
        q=rounded(rng.standard_normal((tokens, heads.q_heads, heads.head_dim))),
        k_pages=rounded(rng.standard_normal(cache)), v_pages=rounded(rng.standard_normal(cache)),
        page_table=random_page_table(rng, kv_lens, max_seqs=max_seqs,
                                     pages_per_seq=pages_per_seq, page_size=PAGE_SIZE,
                                     num_pages=num_pages),
        cu_q_lens=cu_q_lens, kv_lens=kv, num_seqs=np.array([len(q_lens)], np.int32))


def run_kernel_case(case: dict, impl: str, dtype, num_decodes, sm_scale: float):
    """(out, lse) of the kernel on `case` with q and the cache in `dtype`, as numpy."""
    arrays = {k: jnp.asarray(v, dtype) if k in ("q", "k_pages", "v_pages") else jnp.asarray(v)
              for k, v in case.items()}
    if num_decodes is None:
        n = int(case["num_seqs"][0])
        out, lse = jax.jit(lambda q, k, v, pt, kl: decode_attention(
            q, k, v, pt, kl, sm_scale=sm_scale, impl=impl))(
            arrays["q"][:n], arrays["k_pages"], arrays["v_pages"], arrays["page_table"][:n],
            arrays["kv_lens"][:n])
    else:
        out, lse = jax.jit(lambda *a: ragged_paged_attention(
            *a[:-1], sm_scale=sm_scale, impl=impl, num_decodes=a[-1]))(
            *arrays.values(), jnp.array([num_decodes], jnp.int32))
    return np.asarray(out, np.float64), np.asarray(lse, np.float64)


def compare_with_oracle(plan: Plan, rng, q_lens, contexts, num_decodes, dtype: str,
                        sm_scale: float, tolerance: float) -> dict:
    """The largest errors of one kernel case's out and lse against the float64 oracle."""
    case = kernel_case(rng, plan.heads, q_lens, contexts, jnp.dtype(dtype))
    want_out, want_lse = dense_attention_oracle(**case, sm_scale=sm_scale)
    out, lse = run_kernel_case(case, plan.impl, jnp.dtype(dtype), num_decodes, sm_scale)
    real = int(np.asarray(case["cu_q_lens"])[len(q_lens)])
    if num_decodes is None:
        want_out, want_lse = want_out[:len(q_lens)], want_lse[:len(q_lens)]
        real = len(q_lens)
    finite = np.isfinite(want_lse[:real])
    out_error = float(np.abs(out[:real] - want_out[:real]).max())
    lse_error = float(np.abs(lse[:real][finite] - want_lse[:real][finite]).max())
    same_empty = bool((np.isneginf(lse[:real]) == ~finite).all())
    ok = bool(same_empty and not np.isnan(out[:real]).any()
              and max(out_error, lse_error) <= tolerance)
    return {"max_out_error": out_error, "max_lse_error": lse_error, "ok": ok}


def check_kernels(plan: Plan, seed: int, kind: str, log) -> list[dict]:
    """One row per (case, dtype): the largest error of out and lse against the oracle."""
    rows = []
    sm_scale = plan.heads.head_dim ** -0.5
    for dtype in ("float32", "bfloat16"):
        for i, (name, q_lens, contexts, num_decodes) in enumerate(KERNEL_CASES):
            rng = np.random.default_rng([seed, i])
            tolerance = TOLERANCE[(kind, dtype)]
            row = {"case": name, "dtype": dtype, "q_lens": list(q_lens),
                   "contexts": list(contexts), "tolerance": tolerance}
            try:
                row.update(compare_with_oracle(plan, rng, q_lens, contexts, num_decodes, dtype,
                                               sm_scale, tolerance))
            except Exception as error:   # noqa: BLE001: one case's failure (a kernel that
                # does not compile on this device, say) is this row's, not the other cases'
                row.update(error=f"{type(error).__name__}: {error}", ok=False)
                log(f"kernel {name} {dtype} raised:\n{traceback.format_exc()}")
                rows.append(row)
                continue
            rows.append(row)
            log(f"kernel {name} {dtype}: out error {row['max_out_error']:.2e}, lse error "
                f"{row['max_lse_error']:.2e} (tolerance {tolerance:g}): "
                f"{'ok' if row['ok'] else 'FAILED'}")
    return rows


# ----------------------------------------------------------------------------------------
# 2. Greedy tokens against the CPU's
# ----------------------------------------------------------------------------------------


def same_weights_on(model, device, impl: str):
    """`model` (one device) with the same weights on a one-device mesh of `device` and
    attention `impl`."""
    from medha_jax.model.llama import Llama
    from medha_jax.model.loading import Model
    from medha_jax.model.params import MeshLayout, param_specs
    from meshes import ParallelConfig, make_mesh

    layout = MeshLayout.create(model.config, make_mesh(ParallelConfig(), devices=[device]),
                               model.rules, impl)
    placed = {"embed": model.module.embed, "final_norm": model.module.final_norm,
              **({} if model.module.lm_head is None else {"lm_head": model.module.lm_head}),
              **{f"layers.{k}": v for k, v in model.module.layers.items()}}
    params = {name: jax.device_put(np.asarray(placed[name][...]), layout.param_sharding(spec))
              for name, spec in param_specs(model.config).items()}
    return Model(Llama(model.config, params, layout), tokenizer=model.tokenizer)


def greedy_tokens(model, prompts, max_new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens from an Engine on `model` through the Server."""
    from medha_jax import SamplingParams, TokensPrompt
    from medha_jax.engine import Engine, EngineConfig
    from medha_jax.scheduler.predictor import AnalyticalPredictor
    from meshes import ParallelConfig
    from serving.server import Server

    # 32-token steps: the long prompts are chunked over their cache.
    engine = Engine(model, EngineConfig(page_size=PAGE_SIZE, num_pages=64,
                                        max_tokens_per_step=32, max_seqs=4, max_model_len=256))
    predictor = AnalyticalPredictor(model.config, ParallelConfig(), "h100",
                                    token_buckets=engine.ladder.token_buckets)
    with contextlib.redirect_stdout(sys.stderr), Server(
            engine, predictor=predictor, warmup=False, cache_dir=False) as server:
        outputs = server.generate([TokensPrompt(p) for p in prompts],
                                  SamplingParams(temperature=0.0, max_tokens=max_new_tokens))
    return [list(out.token_ids) for out in outputs]


def check_tokens(plan: Plan, seed: int, log) -> dict:
    from medha_jax import load_model
    from meshes import ParallelConfig, make_mesh

    cpu = jax.devices("cpu")[0]
    reference = load_model("tiny", mesh=make_mesh(ParallelConfig(), devices=[cpu]),
                           dtype="float32", attention_impl="xla", seed=seed % 2**31,
                           verbose=False)
    model = same_weights_on(reference, jax.devices()[0], plan.impl)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, reference.config.vocab_size, n).tolist() for n in (70, 9, 41)]
    # Full float32 matmuls on the device too (not TF32), so ties are the model's, not
    # rounding. Set globally, not in a context: the server's loop thread compiles the steps.
    previous = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        want = greedy_tokens(reference, prompts, plan.max_new_tokens)
        got = greedy_tokens(model, prompts, plan.max_new_tokens)
    finally:
        jax.config.update("jax_default_matmul_precision", previous)
    ok = got == want
    log(f"greedy tokens on {jax.devices()[0].platform} ({plan.impl}) vs the CPU (xla): "
        f"{'equal' if ok else 'DIFFERENT'}")
    return {"prompt_lengths": [len(p) for p in prompts], "device_tokens": got,
            "cpu_tokens": want, "ok": ok}


# ----------------------------------------------------------------------------------------
# 3. Kernel table, 4. decode-step breakdown
# ----------------------------------------------------------------------------------------


def kernel_table(plan: Plan, hardware, seed: int, log) -> tuple[dict, dict]:
    """benchmarks.kernels' rows, table and chunking overhead on the plan's grid."""
    dtype = jnp.dtype(plan.table_dtype)
    key, rng = jax.random.key(seed), np.random.default_rng(seed)
    rows = kernels.run_prefill(plan.table_heads, dtype, plan.grid, [plan.impl], plan.repeats,
                               key, rng, log)
    rows += kernels.run_decode(plan.table_heads, dtype, plan.grid, [plan.impl], plan.repeats,
                               key, rng, log)
    overhead = kernels.run_chunking_overhead(plan.table_heads, dtype, plan.grid, plan.impl,
                                             plan.repeats, key, rng, log)
    return kernels.summarize(rows, plan.impl, hardware, None), overhead


def dispatch_seconds(engine, batch, repeats: int) -> float:
    """Median seconds until `Engine.dispatch` returns, the device idle before each. Near the
    whole step where the step's program makes the host wait for the device: on a GPU, XLA
    reads a `lax.cond`'s predicate back to the host before it launches the branch, so the
    launching call returns only once everything before the conditional has run."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        pending = engine.dispatch(batch)
        times.append(time.perf_counter() - start)
        engine.collect(pending)
    return statistics.median(times)


def decode_breakdown(plan: Plan, seed: int, log) -> dict:
    """A decode-only step of plan.breakdown_decodes sequences on an engine over the
    breakdown model, and the decode kernel alone at that step's shapes."""
    from medha_jax import load_model
    from medha_jax.engine import Engine, EngineConfig
    from medha_jax.engine.calibration import borrow_batch, release_batch
    from medha_jax.engine.step_inputs import build_step_inputs
    from medha_jax.model.llama import numpy_dtype

    model = load_model(plan.breakdown_model, attention_impl=plan.impl, seed=seed % 2**31,
                       verbose=False)
    max_context = 1024
    # Room for every decode's context (calibration borrows their pages) and a spare page each.
    engine = Engine(model, EngineConfig(
        page_size=PAGE_SIZE, max_kv_tokens=plan.breakdown_decodes * (max_context + PAGE_SIZE),
        max_tokens_per_step=64, max_seqs=plan.breakdown_decodes, max_model_len=2048))
    rng = np.random.default_rng(seed)
    contexts = rng.integers(64, max_context, plan.breakdown_decodes).tolist()
    chunks = [(int(c), 1) for c in contexts]
    row = engine_bench.measure(engine, f"decode x{len(chunks)}", chunks, rng, plan.repeats)
    # The attention of that step: the same page tables and context lengths, one layer's
    # cache, the decode path, timed alone and counted once per layer.
    batch = borrow_batch(engine, chunks, rng)
    try:
        inputs = build_step_inputs(batch, engine.allocator, engine.ladder,
                                   pad_slot=engine.pad_slot)
        dispatch_ms = 1e3 * dispatch_seconds(engine, batch, plan.repeats)
    finally:
        release_batch(engine, batch)
    c = model.config
    heads = kernels.Heads(c.num_heads, c.num_kv_heads, c.head_dim)
    dtype = jnp.dtype(numpy_dtype(c.dtype))
    seqs = inputs.padded_shape[1]
    # One layer of the cache as the kernels read it, [pages, page_size, kv_heads, head_dim]
    # (the engine stores K/V heads folded into the last axis).
    k_pages = jnp.zeros((*engine.kv_cache.k.shape[1:3], c.num_kv_heads, c.head_dim), dtype)
    q = jax.random.normal(jax.random.key(seed), (seqs, heads.q_heads, heads.head_dim), dtype)
    fn, args = kernels.decode_step(heads, plan.impl, (
        q, k_pages, k_pages, jnp.asarray(inputs.page_table[0]), jnp.asarray(inputs.kv_lens[0])))
    attention_ms = kernels.time_call(fn, args, plan.repeats)["time_s"] * 1e3 * c.num_layers
    row.update(model=plan.breakdown_model, layers=c.num_layers, attention_ms=attention_ms,
               other_device_ms=row["device_ms"] - attention_ms, dispatch_ms=dispatch_ms)
    log(f"decode step of {len(chunks)} on {plan.breakdown_model}: {row['step_ms']:.2f} ms")
    return row


# ----------------------------------------------------------------------------------------


def step_variants(plan: Plan, kind: str, seed: int, quick: bool, log) -> dict:
    """The decode-step breakdown under each of STEP_VARIANTS[kind]'s XLA flags, each run by
    this script in a child process (`--breakdown-only`): name -> its breakdown row."""
    rows = {}
    for name, flags in STEP_VARIANTS[kind].items():
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
        command = [sys.executable, "-m", "benchmarks.gpu_check", "--breakdown-only",
                   "--seed", str(seed), *(["--quick"] if quick else [])]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"the breakdown under XLA_FLAGS={flags!r} failed:\n"
                               f"{done.stderr[-2000:]}")
        rows[name] = {"xla_flags": flags, **json.loads(done.stdout.strip().splitlines()[-1])}
        log(f"decode step under {name!r}: step {rows[name]['step_ms']:.3f} ms, device "
            f"{rows[name]['device_ms']:.3f} ms, dispatch {rows[name]['dispatch_ms']:.3f} ms")
    return rows


def split_sweep(plan: Plan, seed: int, log) -> list[dict]:
    """The decode path's time at each KV-split count (the model's entry point, the ragged
    kernel with every sequence a decode), per context and batch: one row each, with the
    table's own count beside, and each count's output against one split's (ok: within the
    kernel checks' tolerance). On the H200 the table's 16 splits gave a lone 32K-token
    decode 1.2 TB/s, a quarter of the HBM's; this is what the next table is chosen from."""
    if plan.sweep_splits[:1] != (1,):
        raise ValueError(f"the sweep compares every count with 1 split, its first: "
                         f"{plan.sweep_splits}")
    heads, dtype = plan.table_heads, jnp.dtype(plan.table_dtype)
    tolerance = TOLERANCE[("gpu" if plan.impl == "pallas" else "cpu", plan.table_dtype)]
    key, rng = jax.random.key(seed), np.random.default_rng(seed)
    tiles = block_sizes_for(plan.impl, device_kind_of(jax.devices()[0]), heads.head_dim,
                            PAGE_SIZE)
    rows = []
    for context in plan.sweep_contexts:
        for batch in plan.sweep_batches:
            k_pages, v_pages = kernels.paged_cache(key, heads, batch * context, dtype)
            q = jax.random.normal(jax.random.fold_in(key, 2),
                                  (batch, heads.q_heads, heads.head_dim), dtype)
            # The decode step's ragged arguments, as the kernel table times them.
            _, args = kernels.decode_step(heads, plan.impl, (
                q, k_pages, v_pages, kernels.shuffled_page_table(rng, batch, context),
                jnp.full((batch,), context, jnp.int32)))
            moved = (kernels.kv_bytes(heads, batch * context, dtype.itemsize)
                     + 2 * batch * heads.q_heads * heads.head_dim * dtype.itemsize)
            row = {"context": context, "batch": batch, "table_splits": tiles.num_kv_splits,
                   "bytes": moved, "time_ms": {}, "gb_per_s": {}, "max_diff_vs_1": {}}
            unsplit = None
            for splits in plan.sweep_splits:
                fn = jax.jit(functools.partial(
                    ragged_paged_attention, sm_scale=heads.head_dim ** -0.5, impl=plan.impl,
                    block_sizes=dataclasses.replace(tiles, num_kv_splits=splits)))
                # Every sequence a decode: num_decodes is num_seqs, the last argument.
                call = lambda *a, fn=fn: fn(*a, num_decodes=a[-1])   # noqa: E731
                out = np.asarray(call(*args)[0], np.float32)
                unsplit = out if unsplit is None else unsplit      # the first count is 1
                row["max_diff_vs_1"][splits] = float(np.abs(out - unsplit).max())
                seconds = kernels.time_call(call, args, plan.repeats)["time_s"]
                row["time_ms"][splits] = seconds * 1e3
                row["gb_per_s"][splits] = moved / seconds / 1e9
            row["ok"] = max(row["max_diff_vs_1"].values()) <= tolerance
            best = min(row["time_ms"], key=row["time_ms"].get)
            row["best_splits"] = best
            rows.append(row)
            log(f"decode splits, context {context} batch {batch}: best {best} "
                f"({row['time_ms'][best]:.3f} ms), table's {tiles.num_kv_splits}")
            del k_pages, v_pages, args
    return rows


def write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="fewer tokens and repeats; the tiny model for the breakdown")
    p.add_argument("--json", default=None, help="write every figure and the context here")
    p.add_argument("--seed", type=int, default=None, help="default: a fresh one, printed")
    p.add_argument("--step-variants", action=argparse.BooleanOptionalAction, default=None,
                   help="also run the decode-step breakdown under each of STEP_VARIANTS' XLA "
                        "flags, in child processes (default: on a GPU)")
    p.add_argument("--split-sweep", action=argparse.BooleanOptionalAction, default=None,
                   help="also time the decode path at each KV-split count (default: on a GPU)")
    p.add_argument("--breakdown-only", action="store_true",
                   help="run only the decode-step breakdown and print its row as JSON (what "
                        "--step-variants runs in each child)")
    p.add_argument("--hardware", default=None,
                   help="medha_jax.scheduler.hardware preset for the peaks (default: from the "
                        "device kind; none on a CPU)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict:
    from medha_jax.latency_report import format_table

    args = parse_args(argv)
    seed = args.seed if args.seed is not None else secrets.randbits(31)
    backend = jax.default_backend()
    kind = "gpu" if backend in GPU_BACKENDS else "cpu"
    device = jax.devices()[0]
    hardware = kernels.hardware_for(device.device_kind, args.hardware) \
        if kind == "gpu" or args.hardware else None
    plan = plan_for(backend, args.quick, getattr(hardware, "memory_bytes", 16e9))
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.breakdown_only:
        with contextlib.redirect_stdout(sys.stderr):
            row = decode_breakdown(plan, seed, log)
        print(json.dumps(row))
        return {"ok": True, "decode_breakdown": row}
    log(f"gpu-check on {backend} ({device.device_kind}), attention {plan.impl}, seed {seed}")

    report = {"context": {**environment(), "impl": plan.impl, "seed": seed, "quick": args.quick,
                          "hardware_preset": hardware.name if hardware else None,
                          "kernel_heads": dataclasses.asdict(plan.heads),
                          "table_heads": dataclasses.asdict(plan.table_heads),
                          "table_dtype": plan.table_dtype},
              "ok": False, "errors": {}}

    def part(name: str, fn) -> None:
        """Runs one part, whose report entries `fn` returns as a dict; an exception fails
        the run but not the parts after it (on a first device run each part's own result
        is what counts), and the JSON is rewritten after each part, so a run stopped at its
        time limit keeps what it measured."""
        try:
            report.update(fn())
        except Exception as error:   # noqa: BLE001: recorded, printed and failing the run
            report["errors"][name] = f"{type(error).__name__}: {error}"
            log(f"{name} raised:\n{traceback.format_exc()}")
        if args.json:
            write_json(args.json, report)

    def wanted(flag: bool | None) -> bool:
        return kind == "gpu" if flag is None else flag

    part("kernel_checks", lambda: {"kernel_checks": check_kernels(plan, seed, kind, log)})
    part("tokens", lambda: {"tokens": check_tokens(plan, seed, log)})
    part("kernel_table", lambda: dict(zip(("kernel_table", "chunking_overhead"),
                                          kernel_table(plan, hardware, seed, log))))
    part("decode_breakdown", lambda: {"decode_breakdown": decode_breakdown(plan, seed, log)})
    if wanted(args.step_variants):
        part("step_variants",
             lambda: {"step_variants": step_variants(plan, kind, seed, args.quick, log)})
    if wanted(args.split_sweep):
        part("split_sweep", lambda: {"split_sweep": split_sweep(plan, seed, log)})
    checks, tokens = report.get("kernel_checks", []), report.get("tokens")
    table, overhead = report.get("kernel_table", {}), report.get("chunking_overhead")
    breakdown = report.get("decode_breakdown")
    variants, sweep = report.get("step_variants"), report.get("split_sweep")
    ok = report["ok"] = bool(checks and all(row["ok"] for row in checks) and tokens
                             and tokens["ok"] and all(row["ok"] for row in sweep or ())
                             and not report["errors"])
    if args.json:
        write_json(args.json, report)

    if kind == "cpu":
        print("\nCPU run: the kernel in Pallas interpret mode; its times are an "
              "interpreter's, not a device's. Run on a GPU for the figures.")
    for name, error in report["errors"].items():
        print(f"{name} raised {error}")
    print("\nkernels vs the float64 oracle (fresh inputs, seed %d)" % seed)
    print(format_table({f"{r['case']} {r['dtype']}": r for r in checks}, label="case",
                       columns=[("max_out_error", "max_out_error"),
                                ("max_lse_error", "max_lse_error"), ("tolerance", "tolerance"),
                                ("ok", "ok")]))
    if tokens:
        print(f"\ngreedy tokens, {plan.impl} on {backend} vs xla on the CPU "
              f"(tiny, prompts of {tokens['prompt_lengths']} tokens): "
              f"{'equal' if tokens['ok'] else 'DIFFERENT'}")
    if overhead:
        small, large = plan.grid.overhead_chunks
        print(f"chunking overhead at context {overhead['context']}: {small}-token chunks take "
              f"{overhead['ratio']:.3f}x the time of {large}-token chunks")
    if breakdown:
        b = breakdown
        print(f"decode step, {b['scenario']} on {b['model']} ({b['layers']} layers), padded "
              f"{tuple(b['padded_shape'])}: step {b['step_ms']:.3f} ms = device "
              f"{b['device_ms']:.3f} ms (attention {b['attention_ms']:.3f} ms, the rest "
              f"{b['other_device_ms']:.3f} ms) + host on the critical path "
              f"{b['host_overhead_ms']:.3f} ms (building inputs {b['build_inputs_ms']:.3f} ms); "
              f"dispatch returns after {b['dispatch_ms']:.3f} ms")
    if variants:
        print("\nthe decode step under other XLA flags (each in its own process)")
        print(format_table(variants, label="variant", columns=[
            (c, c) for c in ("step_ms", "device_ms", "attention_ms", "other_device_ms",
                             "dispatch_ms")]))
    if sweep:
        print("\ndecode path, ms by KV splits (the table's own count in brackets)")
        print(format_table(
            {f"context {r['context']} batch {r['batch']} ({r['table_splits']})":
             {str(n): t for n, t in r["time_ms"].items()} for r in sweep},
            label="decode", columns=[(str(n), str(n)) for n in plan.sweep_splits]))
    print(f"\ngpu-check: {'PASSED' if ok else 'FAILED'}\n")
    print(format_table(table, label=f"{plan.impl} ({backend})",
                       columns=[(c, c) for c in ("time_ms", "tflop_per_s", "gb_per_s",
                                                 "mfu", "mbu")]))
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
