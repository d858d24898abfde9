"""SPP stages: a model split over the spp slices of its mesh gives the one-stage logits, and
each stage holds only its own layers' weights."""

import dataclasses
import functools
import math

import jax
import numpy as np
import pytest

from medha_jax.config import model_preset
from medha_jax.model.llama import Llama, init_random_params, one_sequence_metadata
from medha_jax.model.loading import Model
from medha_jax.model.params import MeshLayout, param_specs
from medha_jax.model.stages import split_stages, stage_forward, stage_submeshes
from meshes import DEFAULT_RULES, LogicalRules, ParallelConfig, make_mesh
from pallas_kernels.dispatch import resolve_impl

PAGE_SIZE = 16
IMPL = resolve_impl("auto", jax.default_backend())


@functools.lru_cache(maxsize=None)
def _canonical_params(preset: str, num_layers: int) -> dict[str, np.ndarray]:
    """Random weights (seed 0) of the preset with `num_layers` layers, in checkpoint shapes."""
    config = dataclasses.replace(model_preset(preset), num_layers=num_layers, dtype="float32")
    layout = MeshLayout.create(config, make_mesh(ParallelConfig()), DEFAULT_RULES, IMPL)
    specs = param_specs(config)
    return {name: np.asarray(layout.canonical(specs[name], array))
            for name, array in init_random_params(config, layout, jax.random.key(0)).items()}


def new_tiny_model(num_layers: int, parallel: ParallelConfig, preset: str = "tiny",
                   rules: LogicalRules = DEFAULT_RULES) -> Model:
    """The preset with `num_layers` layers on `parallel`'s mesh, the same weights on every mesh.

    load_model takes preset names only, so a 4-layer tiny (needed for spp = 4) is built from
    the pieces load_model uses; weights are drawn once and placed on each mesh (cheaper
    than a random init per mesh, which compiles one program per parameter). Placed now, in
    buffers of its own (a copy: a CPU device_put may alias the host array): an Engine on an
    spp mesh takes its model's weights, so each such engine needs a model of its own."""
    config = dataclasses.replace(model_preset(preset), num_layers=num_layers, dtype="float32")
    layout = MeshLayout.create(config, make_mesh(parallel), rules, IMPL)
    canonical = _canonical_params(preset, num_layers)
    params = {name: jax.device_put(np.array(layout.expand(spec, canonical[name])),
                                   layout.param_sharding(spec))
              for name, spec in param_specs(config).items()}
    return Model(Llama(config, params, layout))


# One model per mesh for tests that only read it (each compiles its own `logits`).
tiny_model = functools.lru_cache(maxsize=None)(new_tiny_model)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("kv_cache",))
def _run_stage(spec, params, kv_cache, x, positions, meta, logits_indices):
    return stage_forward(spec, params, kv_cache, x, positions, meta,
                         logits_indices if spec.is_last else None)


def staged_logits(stages, token_ids, chunk_sizes) -> np.ndarray:
    """float32 logits [tokens, vocab] of a causal forward through the stages, chunk by chunk
    through each stage's paged cache (Model.logits's one-KV-shard case, stage by stage)."""
    ids = np.asarray(token_ids, np.int32)
    per_shard = -(-ids.size // PAGE_SIZE) * PAGE_SIZE
    caches = [stage.new_kv_cache(per_shard // PAGE_SIZE, PAGE_SIZE) for stage in stages]
    out, start = [], 0
    for n in chunk_sizes:
        padded = max(16, 1 << (n - 1).bit_length())
        x = np.zeros(padded, np.int32)
        x[:n] = ids[start:start + n]
        meta = one_sequence_metadata(start, start + n, padded, page_size=PAGE_SIZE,
                                     num_kv_shards=1, tokens_per_shard=per_shard)
        positions = np.arange(start, start + padded, dtype=np.int32)
        rows = np.arange(padded, dtype=np.int32)
        for s, stage in enumerate(stages):
            if s:
                x = jax.device_put(x, stage.spec.hidden_sharding(padded))
            with jax.set_mesh(stage.mesh):
                x, caches[s] = _run_stage(stage.spec, stage.params, caches[s], x, positions,
                                          meta, rows)
        out.append(np.asarray(x)[:n])
        start += n
    return np.concatenate(out)


PROMPT = np.random.default_rng(7).integers(0, 256, 29).tolist()
# A chunked prefill (crossing a page), then decodes: every chunk pads to 16 tokens, so each
# program compiles once.
CHUNKS = [16, 10, 1, 1, 1]


@pytest.mark.parametrize("num_layers,spp,tp", [(2, 2, 1), (2, 2, 2), (4, 4, 1), (4, 4, 2)])
def test_stages_give_the_one_stage_logits(num_layers, spp, tp):
    reference = tiny_model(num_layers, ParallelConfig()).logits(PROMPT, chunk_sizes=CHUNKS)
    stages = split_stages(tiny_model(num_layers, ParallelConfig(spp=spp, tp=tp)))
    assert [s.spec.layer_start for s in stages] == list(range(0, num_layers, num_layers // spp))
    np.testing.assert_allclose(staged_logits(stages, PROMPT, CHUNKS), reference,
                               atol=1e-4, rtol=0)


def test_stage_meshes_are_the_spp_slices():
    model = tiny_model(4, ParallelConfig(spp=4, tp=2))
    meshes = stage_submeshes(model.mesh)
    assert [dict(m.shape) for m in meshes] == [dict(dp=1, spp=1, kvp=1, cp=1, tp=2)] * 4
    devices = [set(m.devices.flat) for m in meshes]
    assert set().union(*devices) == set(model.mesh.devices.flat)
    assert sum(map(len, devices)) == model.mesh.size              # disjoint


def _expected_bytes_per_device(stage) -> int:
    """Bytes one device of the stage must hold: its layers' slices of the stacked weights,
    plus the embedding or the head, each divided over the mesh axes that shard it."""
    spec = stage.spec
    total = 0
    for name in spec.param_names():
        param = param_specs(spec.config)[name]
        shape = list(spec.layout.placed_shape(param))
        if param.per_layer:
            shape[0] = spec.num_layers
        shards = math.prod(spec.mesh.shape[axis]
                           for axis in spec.layout.rules.spec(param.logical_axes) if axis)
        total += math.prod(shape) // shards * 4                    # float32
    return total


@pytest.mark.parametrize("spp,tp", [(2, 1), (4, 2)])
def test_each_stage_holds_only_its_own_weights(spp, tp):
    model = tiny_model(4, ParallelConfig(spp=spp, tp=tp))
    stages = split_stages(model)
    # What a device would hold of the whole stack at this tp (no spp).
    whole = split_stages(tiny_model(4, ParallelConfig(tp=tp)))[0]
    whole_bytes = _expected_bytes_per_device(whole)
    for stage in stages:
        measured = stage.weight_bytes_per_device()
        assert set(measured) == set(stage.mesh.devices.flat)
        expected = _expected_bytes_per_device(stage)
        assert set(measured.values()) == {expected}, (stage.spec.index, measured, expected)
        assert expected < whole_bytes
        stacked = stage.params["layers.wq"]
        assert stacked.shape[0] == 4 // spp
        assert all(shard.data.shape[0] == 4 // spp for shard in stacked.addressable_shards)
    first, last = stages[0].params, stages[-1].params
    assert "embed" in first and "lm_head" not in first and "final_norm" not in first
    assert "embed" not in last and {"lm_head", "final_norm"} <= set(last)


def test_stage_params_are_the_models_slices():
    model = tiny_model(4, ParallelConfig(spp=2, tp=2))
    stages = split_stages(model)
    whole_wq = np.asarray(model.module.layers["wq"][...])
    np.testing.assert_array_equal(
        np.concatenate([np.asarray(s.params["layers.wq"]) for s in stages]), whole_wq)
    np.testing.assert_array_equal(np.asarray(stages[0].params["embed"]),
                                  np.asarray(model.module.embed[...]))


def test_tied_embeddings_put_the_embedding_on_the_last_stage_too():
    stages = split_stages(tiny_model(2, ParallelConfig(spp=2), "tiny-tied"))
    assert "embed" in stages[-1].params and "lm_head" not in stages[-1].params
    reference = tiny_model(2, ParallelConfig(), "tiny-tied")
    np.testing.assert_allclose(staged_logits(stages, PROMPT[:16], [16]),
                               reference.logits(PROMPT[:16]), atol=1e-4, rtol=0)


# Layers replicated over spp (no "layers" rule to the axis): every device holds the whole
# stack, so each stage slices its own layers out of what its devices hold.
REPLICATED_LAYERS = LogicalRules(rules=tuple(
    (logical, None if logical == "layers" else axis) for logical, axis in DEFAULT_RULES.rules))


def test_stages_slice_a_stack_replicated_over_spp():
    model = tiny_model(4, ParallelConfig(spp=2, tp=2), rules=REPLICATED_LAYERS)
    stages = split_stages(model)
    for stage in stages:
        assert set(stage.weight_bytes_per_device().values()) == {_expected_bytes_per_device(stage)}
    reference = tiny_model(4, ParallelConfig()).logits(PROMPT, chunk_sizes=CHUNKS)
    np.testing.assert_allclose(staged_logits(stages, PROMPT, CHUNKS), reference,
                               atol=1e-4, rtol=0)


def test_layers_must_divide_over_the_stages():
    with pytest.raises(ValueError, match=r"num_layers=2.*spp=4"):
        split_stages(tiny_model(2, ParallelConfig(spp=4), rules=REPLICATED_LAYERS))
