"""benchmarks/kernels.py end to end on a tiny grid (the XLA path on the CPU): the table it
prints, the JSON it writes, and that it times the entry point the model uses."""

import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kernels
from pallas_kernels import decode_attention

# One shape per measurement (each a compile of a second or more); the overhead's 32-token
# steps reuse the prefill row's.
TINY = kernels.Grid(contexts=(512,), chunks=(32,), decode_contexts=(256,), decode_batches=(2,),
                    overhead_context=512, overhead_positions=2, max_kv_bytes=1e9,
                    overhead_chunks=(32, 64))
COLUMNS = ("time_ms", "tflop_per_s", "gb_per_s", "mfu", "mbu", "speedup_vs_jax")


def stand_in_baselines(backend, heads):
    """No JAX-shipped kernel runs on a CPU: our own decode_attention stands in for one, so
    the speedup_vs_jax column is filled for decodes (and stays empty for prefill)."""
    def make(q, k_pages, v_pages, page_table, kv_lens):
        fn = jax.jit(lambda *a: decode_attention(*a, sm_scale=heads.head_dim ** -0.5))
        return fn, (q, k_pages, v_pages, page_table, kv_lens)
    return {"stand-in": make}


def test_quick_run_prints_its_table_and_writes_json(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(kernels, "default_grid", lambda backend, quick, memory: TINY)
    monkeypatch.setattr(kernels, "jax_decode_baselines", stand_in_baselines)
    steps = []      # (tokens, num_decodes) of every step timed through the entry point
    entry = kernels.ragged_paged_attention

    def spy(q, *args, num_decodes, **kwargs):
        jax.debug.callback(lambda n, t=q.shape[0]: steps.append((t, int(n[0]))), num_decodes)
        return entry(q, *args, num_decodes=num_decodes, **kwargs)

    monkeypatch.setattr(kernels, "ragged_paged_attention", spy)
    kernels.split_path_fn.cache_clear()     # its jitted steps must trace the spy
    path = tmp_path / "kernels.json"
    # --hardware: peaks on a CPU, so MFU and MBU are figures, not "-".
    kernels.main(["--quick", "--json", str(path), "--hardware", "h100", "--repeats", "1"])

    printed = capsys.readouterr().out
    assert "chunking overhead at context 512: 32-token chunks take" in printed
    lines = printed.splitlines()
    header = lines.index(next(line for line in lines if line.startswith("xla (cpu)")))
    assert lines[header].split()[2:] == [*COLUMNS, "jax_kernel"]
    assert lines[header + 2].startswith("prefill ctx=512 chunk=32")
    assert lines[header + 3].split()[:3] == ["decode", "ctx=256", "batch=2"]
    assert lines[header + 3].split()[-1] == "stand-in"     # the JAX kernel it compared with
    # One long decode among short ones (256 and 256 / 16 keys): no JAX kernel compared.
    assert lines[header + 4].startswith("decode ctx=256 batch=2 ragged (others ctx/16)")

    report = json.loads(path.read_text())
    assert report["context"]["impl"] == "xla" and report["context"]["hardware_preset"] == "h100"
    table = report["table"]
    assert len(table) == 3 and all(set(COLUMNS) <= set(entry) for entry in table.values())
    for name, entry in table.items():
        kind = name.split()[0]
        assert all(entry[c] > 0 for c in ("time_ms", "tflop_per_s", "gb_per_s"))
        assert (entry["mfu"] is None) == (kind == "decode")      # MFU for prefill,
        assert (entry["mbu"] is None) == (kind == "prefill")     # MBU for decodes
        assert (entry["speedup_vs_jax"] is None) == (kind == "prefill" or "ragged" in name)
    heads = kernels.Heads(**report["context"]["heads"])
    ragged = next(row for row in report["rows"] if row.get("ragged"))   # the keys it reads
    assert ragged["bytes"] == (kernels.kv_bytes(heads, 256 + 256 // 16, 4)
                               + 2 * 2 * heads.q_heads * heads.head_dim * 4)
    overhead = report["chunking_overhead"]
    assert overhead["context"] == 512 and overhead["ratio"] > 0
    assert overhead["chunk_32"]["steps"] == 16 and overhead["chunk_64"]["steps"] == 8

    # Prefill chunks with no decode, decode batches all decodes (the model's split path,
    # not decode_attention with the table's raw KV splits).
    assert set(steps) == {(2, 2), (32, 0), (64, 0)}
    assert all(np.isfinite(row["xla"]["time_s"]) for row in report["rows"])


def test_chained_timing_runs_every_call_and_returns_one_calls_output():
    # Off the CPU a sample runs the call `calls` times in one program: none may be hoisted out
    # of the loop or dropped (counted on the host through a callback), and the dependency
    # through the first argument changes nothing (its output is one call's).
    counted = []

    def fn(x, w):
        jax.debug.callback(lambda: counted.append(1))
        return jnp.tanh(x @ w), x.sum()

    x, w = jax.random.normal(jax.random.key(0), (2, 8, 8))
    run = kernels.chained_calls(fn, 5)
    out = jax.block_until_ready(run(jnp.zeros(()), x, w))
    assert len(counted) == 5
    np.testing.assert_allclose(out[0], np.tanh(np.asarray(x) @ np.asarray(w)), rtol=1e-5)
    counted.clear()
    timing = kernels.time_call(fn, (x, w), repeats=3, chained=True)
    calls = timing["calls_per_sample"]
    assert 2 <= calls <= kernels.MAX_CHAINED_CALLS
    assert len(counted) == 2 + calls * 4      # two single calls, the compile run, 3 samples
    assert 0 < timing["time_min_s"] <= timing["time_s"] <= timing["time_max_s"]
