"""The experiment behind h200-dispatch.jsonl: does a step's dispatch block the host?

Times Engine.dispatch (building the inputs and the executable call's return) and the
whole step for a decode of N sequences, alone and with two steps in flight, with the
step's lax.conds as served or (--select) every lax.cond traced as a select of both
branches (jax.lax.cond replaced before the model is imported: an experiment, not a mode
of the engine). Run on the H200 as

    python3 docs/gpu/dispatch_experiment.py --label base --json OUT
    python3 docs/gpu/dispatch_experiment.py --select --label select --json OUT
    XLA_FLAGS=--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE \
        python3 docs/gpu/dispatch_experiment.py --label cmdbuf --json OUT

(from the repository root, PYTHONPATH=.). `benchmarks.gpu_check`'s breakdown reports the
served variant's dispatch time on every run (dispatch_ms)."""
import argparse, json, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np

p = argparse.ArgumentParser()
p.add_argument("--model", default="llama3-8b")
p.add_argument("--decodes", type=int, default=32)
p.add_argument("--select", action="store_true")
p.add_argument("--repeats", type=int, default=10)
p.add_argument("--label", default="")
p.add_argument("--json")
a = p.parse_args()

if a.select:
    real_cond = jax.lax.cond
    def select_cond(pred, true_fn, false_fn, *ops):
        t, f = true_fn(*ops), false_fn(*ops)
        return jax.tree.map(lambda x, y: jnp.where(pred, x, y), t, f)
    jax.lax.cond = select_cond

from medha_jax import load_model
from medha_jax.engine import Engine, EngineConfig
from medha_jax.engine.calibration import borrow_batch, release_batch

impl = "pallas" if jax.default_backend() == "gpu" else "xla"
model = load_model(a.model, attention_impl=impl, seed=0, verbose=False)
engine = Engine(model, EngineConfig(page_size=16, max_kv_tokens=a.decodes * 1040,
                                    max_tokens_per_step=64, max_seqs=a.decodes,
                                    max_model_len=2048))
rng = np.random.default_rng(0)
chunks = [(int(c), 1) for c in rng.integers(64, 1024, a.decodes)]
batch = borrow_batch(engine, chunks, rng)
rows = {}
try:
    from medha_jax.engine.step_inputs import build_step_inputs
    inputs = build_step_inputs(batch, engine.allocator, engine.ladder, pad_slot=engine.pad_slot)
    engine.warmup(progress=False, shapes=[inputs.padded_shape])
    engine.execute(batch); engine.execute(batch)
    lone_dispatch, lone_total, piped = [], [], []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        pending = engine.dispatch(batch)
        t1 = time.perf_counter()
        engine.collect(pending)
        t2 = time.perf_counter()
        lone_dispatch.append(t1 - t0); lone_total.append(t2 - t0)
    # Two in flight, as the server runs: dispatch the next before collecting the last.
    pending = engine.dispatch(batch)
    t0 = time.perf_counter()
    for _ in range(a.repeats):
        nxt = engine.dispatch(batch)
        engine.collect(pending)
        pending = nxt
    engine.collect(pending)
    piped_step = (time.perf_counter() - t0) / (a.repeats + 1)
    rows = {"label": a.label, "select": a.select, "model": a.model, "decodes": a.decodes,
            "dispatch_ms": 1e3 * statistics.median(lone_dispatch),
            "lone_step_ms": 1e3 * statistics.median(lone_total),
            "pipelined_step_ms": 1e3 * piped_step}
finally:
    release_batch(engine, batch)

# The timing floor of benchmarks.kernels.time_call: a tiny jitted call, blocked each time.
f = jax.jit(lambda x: x + 1)
x = jnp.ones((8,))
jax.block_until_ready(f(x))
ts = []
for _ in range(50):
    t = time.perf_counter(); jax.block_until_ready(f(x)); ts.append(time.perf_counter() - t)
rows["blocked_tiny_call_us"] = 1e6 * statistics.median(ts)
t = time.perf_counter()
for _ in range(200):
    x = f(x)
jax.block_until_ready(x)
rows["async_tiny_call_us"] = 1e6 * (time.perf_counter() - t) / 200
print(json.dumps(rows))
if a.json:
    with open(a.json, "a") as fh:
        fh.write(json.dumps(rows) + "\n")
