"""benchmarks/engine.py's step breakdown: exclusive op times by category, from a trace and
the compiled HLO's op names."""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import engine as bench


def test_nested_ops_count_exclusively_per_thread_and_runtime_events_are_ignored():
    op_names = {
        "while.1": "jit(step)/while/body/jit(ragged_paged_attention)/while",
        "dot.1": "jit(step)/while/body/closed_call/td,df->tf/dot_general",
        "fusion.2": "jit(step)/while/body/rsqrt",
        "ds.3": "jit(step)/while/body/jit(dynamic_index_in_dim)/dynamic_slice",
    }
    events = [
        {"ph": "X", "name": "ThunkExecutor::Execute", "ts": 0, "dur": 200, "tid": 1},
        {"ph": "X", "name": "while.1", "ts": 0, "dur": 100, "tid": 1},
        {"ph": "X", "name": "dot.1", "ts": 10, "dur": 30, "tid": 1},     # inside the loop
        {"ph": "X", "name": "fusion.2", "ts": 50, "dur": 10, "tid": 1},  # inside the loop
        {"ph": "X", "name": "ds.3", "ts": 120, "dur": 5, "tid": 1},
        {"ph": "X", "name": "dot.1", "ts": 5, "dur": 20, "tid": 2},      # another thread
        {"ph": "i", "name": "dot.1", "ts": 0, "tid": 1},                 # not a complete event
    ]
    seconds = bench.exclusive_seconds(events, op_names)
    assert {k: round(v * 1e6) for k, v in seconds.items()} == {
        "attention": 60, "dense layers": 50, bench.OTHER: 10, "layer weights sliced": 5}


def test_op_names_are_read_from_compiled_hlo_and_the_breakdown_sums_the_step():
    a, b = jnp.ones((64, 32)), jnp.ones((32, 16))
    compiled = jax.jit(lambda a, b: jnp.tanh(a @ b)).lower(a, b).compile()
    names = bench.hlo_op_names(compiled.as_text())
    assert any(op.endswith("dot_general") for op in names.values())
    assert bench.category_of("jit(step)/sd,dv->sv/dot_general") == "LM head"
    assert bench.category_of("jit(step)/cond/sampler/argmax") == "sampling"


def test_measure_splits_a_tiny_models_step():
    from medha_jax import load_model
    from medha_jax.engine import Engine, EngineConfig

    engine = Engine(load_model("tiny", verbose=False),
                    EngineConfig(max_kv_tokens=4096, max_tokens_per_step=64, max_seqs=8,
                                 max_model_len=512))
    row = bench.measure(engine, "mixed", [(100, 1), (100, 1), (0, 40)],
                        np.random.default_rng(0), repeats=2, breakdown=True)
    parts = row["breakdown_ms"]
    assert parts["dense layers"] > 0 and parts["attention"] > 0
    assert set(parts) <= {name for name, _ in bench.BREAKDOWN_CATEGORIES} | {bench.OTHER}
    bench.print_breakdown([row])


def test_cpu_kernels_rows_compare_the_two_paths_side_by_side():
    from pallas_kernels import cpu_native

    rows = bench.run_cpu_kernels("tiny", quick=True, repeats=1)
    if not cpu_native.available():
        assert rows == []
        return
    cases = [f"decode x{n}" for n in (1, 2, 4, 8)] + [
        "prefill 256", "prefill 256 @ctx 1024", "mixed 8 decodes + 128 chunk"]
    assert [r["scenario"] for r in rows] == [
        f"{case}, {path}" for path in ("xla path", "cpu kernels") for case in cases]
    assert all(r["vs_xla_path"] > 0 for r in rows)
    assert [r["vs_xla_path"] for r in rows[:len(cases)]] == [1.0] * len(cases)
