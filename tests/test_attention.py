"""The model's attention wrapper: specs from the rules, the kernel per device, KV shards merged."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from medha_jax import ParallelConfig, load_model
from medha_jax.model.attention import num_kv_shards
from medha_jax.model.llama import one_sequence_metadata
from medha_jax.model.loading import _chunk_logits
from meshes import DEFAULT_RULES, LogicalRules


@pytest.fixture(scope="module")
def one_device_logits():
    ids = np.random.default_rng(0).integers(0, 256, 30).tolist()
    return ids, load_model("tiny", verbose=False).logits(ids)


def shard_map_specs(model, num_tokens=16):
    """The in_specs of every shard_map in the jaxpr of a one-chunk forward."""
    return [specs for specs, _ in shard_maps(model, num_tokens)]


def shard_maps(model, num_tokens=16):
    """(in_specs, names of every primitive in its body, nested ones included) of every
    shard_map in the jaxpr of a one-chunk forward."""
    shards = num_kv_shards(model.layout)
    meta = one_sequence_metadata(0, num_tokens, num_tokens, page_size=16, num_kv_shards=shards,
                                 tokens_per_shard=num_tokens)
    with jax.set_mesh(model.mesh):
        jaxpr = jax.make_jaxpr(functools.partial(_chunk_logits, model.graphdef))(
            model.state, model.new_kv_cache(shards, 16), jnp.zeros(num_tokens, jnp.int32),
            jnp.arange(num_tokens, dtype=jnp.int32), meta)
    found = []

    def walk(jaxpr, seen: set[str]):
        for eqn in jaxpr.eqns:
            seen.add(eqn.primitive.name)
            body = set()
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    walk(inner, body)
            seen |= body
            if eqn.primitive.name == "shard_map":
                found.append((eqn.params["in_specs"], body))
    walk(jaxpr.jaxpr, set())
    return found


# tiny has 8 query heads and 2 K/V heads: tp=2 splits both, tp=4 and tp=8 repeat each K/V
# head 2 and 4 times so every device holds its own group's K/V and the kernel still runs.
@pytest.mark.parametrize("parallel", [ParallelConfig(tp=2), ParallelConfig(tp=4),
                                      ParallelConfig(tp=8)], ids=str)
def test_pallas_kernel_under_shard_map_matches_one_device(one_device_logits, parallel):
    ids, expected = one_device_logits
    model = load_model("tiny", parallel=parallel, attention_impl="interpret", verbose=False)
    assert model.layout.attention_impl == "interpret"
    maps = shard_maps(model)
    assert maps and maps[0][0][0] == P("cp", "tp", None)     # heads split over tp
    # The Pallas kernel itself is called inside the per-device body, not a jnp fallback
    # (deleting the kernel call in pallas_kernels/attention.py makes this fail).
    assert all("pallas_call" in body for _, body in maps), [sorted(b) for _, b in maps]
    np.testing.assert_allclose(model.logits(ids), expected, atol=2e-5, rtol=0)


def test_shard_map_specs_come_from_the_models_rules(one_device_logits):
    ids, expected = one_device_logits
    # Attention replicated (heads and K/V heads on no axis), MLP and vocabulary over tp.
    rules = LogicalRules(rules=tuple((name, None if name in ("heads", "kv_heads") else axis)
                                     for name, axis in DEFAULT_RULES.rules))
    model = load_model("tiny", parallel=ParallelConfig(tp=2), rules=rules, verbose=False)
    assert model.layout.rules == rules
    q_spec, k_spec = shard_map_specs(model)[0][:2]
    assert q_spec == k_spec == P("cp", None, None)
    default_specs = shard_map_specs(load_model("tiny", parallel=ParallelConfig(tp=2),
                                               verbose=False))[0]
    assert default_specs[0] == P("cp", "tp", None)
    np.testing.assert_allclose(model.logits(ids), expected, atol=2e-5, rtol=0)


def test_pallas_on_the_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="'pallas' needs a GPU"):
        load_model("tiny", attention_impl="pallas", verbose=False)


# ------------------------------------------------------------- the cache is never copied

def cache_copies(parallel, pages_per_shard, preset="tiny", tokens=16, *, collectives=False):
    """(bytes of one layer of one device's K cache, the copies, transposes and
    dynamic-update-slices at least that large) of the engine's compiled decode step of
    `tokens` tokens; with `collectives`, the collectives at least that large instead."""
    from medha_jax import hlo
    from medha_jax.engine import Engine, EngineConfig

    model = load_model(preset, parallel=parallel, verbose=False)
    # max_model_len fixes the page tables' width, so only the cache differs between sizes.
    engine = Engine(model, EngineConfig(page_size=16, num_pages=pages_per_shard,
                                        max_tokens_per_step=16, max_seqs=8, max_model_len=256,
                                        min_token_bucket=tokens))
    shape, sharding = model.kv_cache_sharding(engine.num_kv_shards * pages_per_shard, 16)
    local = sharding.shard_shape(shape)                          # [L, pages, page_size, ...]
    layer_bytes = math.prod(local[1:]) * np.dtype(np.float32).itemsize
    # The narrowest shape of `tokens` tokens and 8 sequences, or `tokens` below 8 (the
    # sequence rung is capped at the token bucket), with cp also its fewest packed pages.
    compiled = engine.executable(min(s for s in engine.ladder.all_shapes()
                                     if s[:2] == (tokens, min(tokens, 8))))
    if collectives:
        return layer_bytes, [c for c in hlo.collectives(compiled.as_text())
                             if c.bytes >= layer_bytes]
    return layer_bytes, hlo.copies(compiled.as_text(), min_bytes=layer_bytes)


# tiny has 2 K/V heads: tp=2 leaves one K/V head per device, whose size-1 heads axis XLA
# re-laid out (a copy of the whole cache at the step's entry and exit, and per layer in the
# scan) before the cache folded heads into its last axis; kvp and cp split the pages as
# well (cp's ring hands the cache through a cond). The sizes keep one layer of the cache
# above anything a step of 8 sequences gathers (8 x 16 pages).
@pytest.mark.parametrize("parallel", [ParallelConfig(), ParallelConfig(tp=2),
                                      ParallelConfig(kvp=2, tp=2), ParallelConfig(cp=2, tp=2),
                                      ParallelConfig(kvp=2, cp=2, tp=2)],
                         ids=str)
def test_the_decode_step_never_copies_the_kv_cache(parallel):
    for pages_per_shard in (256, 1024):
        layer_bytes, found = cache_copies(parallel, pages_per_shard)
        # Only the scatters of this step's slots touch the cache; nothing rewrites a layer.
        assert not found, (pages_per_shard, layer_bytes,
                           [(c.op, c.shape, c.count, c.computation) for c in found])


@pytest.mark.parametrize("parallel", [ParallelConfig(kvp=2, tp=2), ParallelConfig(cp=2, tp=2),
                                      ParallelConfig(kvp=2, cp=2, tp=2)], ids=str)
def test_the_decode_step_moves_no_layer_of_the_kv_cache_between_devices(parallel):
    """kvp merges partial outputs and cp's ring sends the step's packed cached pages: no
    collective of the step (all-gather of the pages included) is as large as one layer of
    a device's cache."""
    layer_bytes, found = cache_copies(parallel, 1024, collectives=True)
    assert not found, (layer_bytes, [(c.op, c.shape, c.bytes, c.count) for c in found])


@pytest.mark.parametrize("parallel", [ParallelConfig(), ParallelConfig(kvp=2)], ids=str)
def test_a_one_token_step_never_copies_the_kv_cache(parallel):
    """A one-token step (min_token_bucket=1: a lone decode) writes one slot: XLA turns a
    one-row scatter into a dynamic-update-slice guarded by a select (mode="drop"), which
    cannot run in place, and copied the whole cache three times per layer (21 s for one
    SmolLM2 decode on 2 cores) until the write kept a second, dropped row."""
    layer_bytes, found = cache_copies(parallel, 1024, tokens=1)
    assert not found, (layer_bytes, [(c.op, c.shape, c.count, c.computation) for c in found])


@pytest.mark.parametrize("parallel", [ParallelConfig(), ParallelConfig(tp=2)], ids=str)
def test_the_per_layer_window_cond_never_copies_the_kv_cache(parallel):
    """Gemma-3's layers choose windowed or full attention by a lax.cond that reads the
    whole cache (the layer's pages by offset): no branch copies it."""
    layer_bytes, found = cache_copies(parallel, 1024, preset="tiny-gemma3")
    assert not found, (layer_bytes, [(c.op, c.shape, c.count, c.computation) for c in found])
