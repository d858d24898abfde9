"""Shared pieces of the attention tests: ragged batches, a hypothesis strategy drawing them,
and the one comparison of results against the dense oracle."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from pallas_kernels import order_decodes_first
from pallas_kernels.dense_reference import dense_attention_oracle, random_page_table


def assert_attention_close(out, lse, want_out, want_lse, atol=2e-5):
    """out [T, H, D] and lse [T, H] equal the expected ones: no NaN, the same -inf rows
    (queries that saw no key), values within float32 tolerance."""
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, want_out, atol=atol, rtol=1e-4)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], atol=atol, rtol=1e-5)


def run_on_devices(script: str, num_devices: int, timeout: int = 900) -> str:
    """Runs the Python `script` in a child process with `num_devices` virtual CPU devices
    and returns its stdout; fails with the child's output.

    For the TPU interpreter on a mesh: it hangs with the 8 devices this suite's conftest
    sets up, and the device count is fixed once JAX starts. The child imports this checkout
    (PYTHONPATH); XLA's backend optimisations are off, as in test_tpu_paged_kernel.py (the
    interpreter's programs are compiled far more than they run).
    """
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices} "
                         "--xla_backend_optimization_level=0",
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Static buffer shapes of one batch family."""
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    num_tokens: int = 40
    max_seqs: int = 5
    pages_per_seq: int = 10

    @property
    def num_pages(self):
        return self.max_seqs * self.pages_per_seq + 3

    @property
    def max_context(self):
        return self.pages_per_seq * self.page_size


def make_batch(seed: int, shapes: Shapes, q_lens, contexts, *, causal=True, dtype=np.float32):
    """Numpy arguments of `ragged_paged_attention`: sequence s has q_lens[s] queries and
    contexts[s] keys before them. causal: the queries' own keys are in the cache too
    (kv_len = context + q_len); otherwise the cache holds only the prefix (kv_len = context)."""
    rng = np.random.default_rng(seed)
    num_seqs = len(q_lens)
    kv_lens = [c + n for c, n in zip(contexts, q_lens)] if causal else list(contexts)
    cu_q_lens = np.full(shapes.max_seqs + 1, sum(q_lens), np.int32)
    cu_q_lens[: num_seqs + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv_lens_arr = np.zeros(shapes.max_seqs, np.int32)
    kv_lens_arr[:num_seqs] = kv_lens
    cache_shape = (shapes.num_pages, shapes.page_size, shapes.kv_heads, shapes.head_dim)
    return dict(
        q=rng.standard_normal((shapes.num_tokens, shapes.q_heads, shapes.head_dim)).astype(dtype),
        k_pages=rng.standard_normal(cache_shape).astype(dtype),
        v_pages=rng.standard_normal(cache_shape).astype(dtype),
        page_table=random_page_table(rng, kv_lens, max_seqs=shapes.max_seqs,
                                     pages_per_seq=shapes.pages_per_seq,
                                     page_size=shapes.page_size, num_pages=shapes.num_pages),
        cu_q_lens=cu_q_lens, kv_lens=kv_lens_arr, num_seqs=np.array([num_seqs], np.int32))


@st.composite
def ragged_batches(draw, shapes_choices, max_chunk=24, causal=True):
    """(shapes, seed, q_lens, contexts): a mix of decodes, 1-token and longer chunks, chunks
    with no context, and (causal=False) contexts that fill the whole page table."""
    shapes = draw(st.sampled_from(shapes_choices))
    num_seqs = draw(st.integers(1, shapes.max_seqs))
    q_lens, contexts, tokens_left = [], [], shapes.num_tokens
    for _ in range(num_seqs):
        if tokens_left == 0:
            break
        kind = draw(st.sampled_from(["decode", "chunk", "chunk", "no_context"]))
        q_len = 1 if kind == "decode" else draw(st.integers(1, min(tokens_left, max_chunk)))
        # Causal batches keep room for the queries' own keys; a prefix may fill the table.
        room = shapes.max_context - (q_len if causal else 0)
        context = 0 if kind == "no_context" else draw(st.one_of(
            st.integers(0, room), st.just(room)))
        q_lens.append(q_len)
        contexts.append(context)
        tokens_left -= q_len
    return shapes, draw(st.integers(0, 2**31 - 1)), q_lens, contexts


def assert_matches_oracle(out, lse, batch, sm_scale, *, causal=True, atol=2e-5,
                          sliding_window=None, window_starts=None):
    """Equal to the dense oracle, and exactly 0 / -inf on the padding tail."""
    want_out, want_lse = dense_attention_oracle(**batch, sm_scale=sm_scale, causal=causal,
                                                sliding_window=sliding_window,
                                                window_starts=window_starts)
    assert_attention_close(out, lse, want_out, want_lse, atol=atol)
    out, lse = np.asarray(out), np.asarray(lse)
    padding = np.arange(out.shape[0]) >= batch["cu_q_lens"][batch["num_seqs"][0]]
    assert (out[padding] == 0).all() and np.isneginf(lse[padding]).all()


def shard_window_batch(seed: int, shapes: Shapes, q_lens, contexts, *, starts_past=None):
    """A non-causal batch (a KV shard's prefix) and each query's first key on it
    (window_starts, int32 [tokens]): windows starting before, inside and past the keys;
    starts_past: a sequence all of whose queries start past its keys (a shard wholly
    before their windows)."""
    batch = make_batch(seed, shapes, q_lens, contexts, causal=False)
    rng = np.random.default_rng(seed)
    seq = np.repeat(np.arange(len(q_lens)), q_lens)
    starts = np.zeros(shapes.num_tokens, np.int32)
    starts[:len(seq)] = rng.integers(0, np.array(contexts)[seq] + 4)
    if starts_past is not None:
        starts[:len(seq)][seq == starts_past] = contexts[starts_past] + rng.integers(0, 3)
    return batch, starts


def poison_skipped_pages(batch, starts, block_kv: int):
    """`batch` with NaN K/V in each sequence's pages that lie in tiles of block_kv keys
    wholly before every one of its queries' window_starts: a kernel that skips those tiles
    never reads them, one that reads and masks them gets NaN (0 x NaN) in its output.
    Page-table entries past a sequence's pages (and padding rows) point at a spare finite
    page, so masked tails read no NaN."""
    batch = {**batch, "k_pages": batch["k_pages"].copy(), "v_pages": batch["v_pages"].copy(),
             "page_table": batch["page_table"].copy()}
    table, cu, page_size = batch["page_table"], batch["cu_q_lens"], batch["k_pages"].shape[1]
    owned = [int(-(-n // page_size)) for n in batch["kv_lens"]]
    spare = min(set(range(batch["k_pages"].shape[0]))
                - {int(p) for row, n in zip(table, owned) for p in row[:n]})
    for s, n in enumerate(owned):
        queries = np.asarray(starts)[cu[s]:cu[s + 1]]
        if s < batch["num_seqs"][0] and queries.size:
            skipped = min(int(queries.min()) // block_kv * block_kv // page_size, n)
            for kv in ("k_pages", "v_pages"):
                batch[kv][table[s, :skipped]] = np.nan
        table[s, n:] = spare
    return batch


def decodes_first(q_lens, contexts):
    """(q_lens, contexts, num_decodes int32 [1]) in the order the decode/prefill split
    wants (`order_decodes_first`): the one-token sequences first."""
    order, num_decodes = order_decodes_first(q_lens)
    return ([q_lens[i] for i in order], [contexts[i] for i in order],
            np.array([num_decodes], np.int32))


def as_bfloat16(batch):
    """(the batch with q and the cache in bfloat16, the same rounded back to float32 for
    the oracle)."""
    bf16 = {k: (v.astype(jnp.bfloat16) if v.dtype == np.float32 else v) for k, v in batch.items()}
    rounded = {k: np.asarray(v, np.float32) if k in ("q", "k_pages", "v_pages") else v
               for k, v in bf16.items()}
    return bf16, rounded


def mark_kernels(monkeypatch, module, marks):
    """Wraps each kernel `module.name` of marks {name: offset} to add its offset to its
    output, so a result shows which kernel served each token. The caller clears JAX's
    caches so jitted entry points trace the wrappers."""
    for name, mark in marks.items():
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _k=kernel, _m=mark, **kw: (
            (lambda out, lse: (out + _m, lse))(*_k(*a, **kw))))


def per_layer_window_outputs(impl: str, shapes: Shapes, q_lens, contexts, window: int, *,
                             seed: int = 0, num_decodes=None, block_sizes=None):
    """(out of layer 0, out of layer 1, the batch): the model's attention over two layers of
    one cache (the same K/V in both) under a layer scan whose per-layer flag windows layer 0
    and not layer 1 (Gemma-3's sliding and full layers). The step's own K/V are dropped
    (slots past the end): the batch's cache already holds them, as `make_batch` lays it."""
    import jax

    from medha_jax.config import ModelConfig
    from medha_jax.model.attention import AttentionMetadata, attention
    from medha_jax.model.params import MeshLayout
    from meshes import DEFAULT_RULES, ParallelConfig, make_mesh

    batch = make_batch(seed, shapes, q_lens, contexts)
    config = ModelConfig(vocab_size=8, hidden_size=8, num_layers=2, num_heads=shapes.q_heads,
                         num_kv_heads=shapes.kv_heads, head_dim=shapes.head_dim,
                         intermediate_size=8, sliding_window=window)
    layout = MeshLayout.create(config, make_mesh(ParallelConfig()), DEFAULT_RULES, impl)
    num_pages, page_size = batch["k_pages"].shape[:2]

    def fold(pages):   # [P, page_size, K, hd] -> two layers of [P, page_size, K * hd]
        return jnp.stack([jnp.asarray(pages).reshape(num_pages, page_size, -1)] * 2)

    meta = AttentionMetadata(
        slot_mapping=jnp.full((1, shapes.num_tokens), num_pages * page_size, jnp.int32),
        page_table=jnp.asarray(batch["page_table"])[None],
        cu_q_lens=jnp.asarray(batch["cu_q_lens"]), kv_lens=jnp.asarray(batch["kv_lens"])[None],
        num_seqs=jnp.asarray(batch["num_seqs"]),
        num_decodes=None if num_decodes is None else jnp.asarray(num_decodes))
    q = jnp.asarray(batch["q"])
    dropped = jnp.zeros((shapes.num_tokens, shapes.kv_heads, shapes.head_dim), q.dtype)

    @jax.jit
    def layers(k_cache, v_cache):
        def layer(carry, xs):
            layer_id, windowed = xs
            out, k_cache, v_cache = attention(q, dropped, dropped, *carry, layer_id, meta,
                                              layout=layout, sm_scale=0.2,
                                              sliding_window=window, windowed=windowed)
            return (k_cache, v_cache), out
        return jax.lax.scan(layer, (k_cache, v_cache),
                            (jnp.arange(2, dtype=jnp.int32), jnp.array([True, False])))[1]

    outs = layers(fold(batch["k_pages"]), fold(batch["v_pages"]))
    return np.asarray(outs[0]), np.asarray(outs[1]), batch


def assert_per_layer_window(impl: str, shapes: Shapes, q_lens, contexts, window: int, **kw):
    """Layer 0 equals the dense oracle with the window, layer 1 without; and they differ."""
    windowed, full, batch = per_layer_window_outputs(impl, shapes, q_lens, contexts, window,
                                                     **kw)
    for out, w in ((windowed, window), (full, None)):
        want, _ = dense_attention_oracle(**batch, sm_scale=0.2, sliding_window=w)
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)
    assert np.abs(windowed - full).max() > 1e-2
