"""The parameter table and its placement on a mesh (vocabulary padding, repeated K/V heads)."""

import numpy as np
import pytest

from medha_jax.config import FAMILIES, ModelConfig, model_preset
from medha_jax.model.params import MeshLayout, checkpoint_names, param_specs
from meshes import DEFAULT_RULES, LogicalRules, ParallelConfig, make_mesh


def odd_config(**overrides):
    fields = dict(name="odd", vocab_size=257, hidden_size=32, num_layers=2, num_heads=8,
                  num_kv_heads=2, head_dim=8, intermediate_size=48)
    return ModelConfig(**{**fields, **overrides})


def test_table_lists_every_parameter_once_with_shapes_from_the_config():
    config = model_preset("tiny")
    specs = param_specs(config)
    assert specs["layers.wq"].shape == (2, 64, 8, 16)
    assert specs["layers.wk"].logical_axes == ("layers", "embed", "kv_heads", "head_dim")
    assert specs["lm_head"].shape == (64, 256)
    assert "lm_head" not in param_specs(model_preset("tiny-tied"))
    assert {s.init for s in specs.values()} == {"normal", "ones"}
    hf, gguf = checkpoint_names("hf"), checkpoint_names("gguf")
    assert hf["layers.wq"] == "model.layers.{layer}.self_attn.q_proj.weight"
    assert gguf["lm_head"] == "output.weight"
    every_family = set().union(*(param_specs(odd_config(family=f)) for f in FAMILIES))
    assert set(hf) == set(gguf) == every_family


def test_families_are_rows_added_to_the_llama_table():
    llama = param_specs(odd_config())
    qwen2, qwen3 = param_specs(odd_config(family="qwen2")), param_specs(odd_config(family="qwen3"))
    assert set(qwen2) - set(llama) == {"layers.bq", "layers.bk", "layers.bv"}
    assert qwen2["layers.bq"].shape == (2, 8, 8)
    assert qwen2["layers.bk"].logical_axes == ("layers", "kv_heads", "head_dim")
    assert qwen2["layers.bq"].hf_name == "model.layers.{layer}.self_attn.q_proj.bias"
    assert set(qwen3) - set(llama) == {"layers.q_norm", "layers.k_norm"}
    assert qwen3["layers.k_norm"].shape == (2, 8) and qwen3["layers.k_norm"].init == "ones"
    assert qwen3["layers.q_norm"].gguf_name == "blk.{layer}.attn_q_norm.weight"
    assert param_specs(odd_config(family="mistral")) == llama
    gemma = param_specs(odd_config(family="gemma3"))
    assert set(gemma) - set(llama) == {"layers.q_norm", "layers.k_norm", "layers.post_attn_norm",
                                       "layers.post_mlp_norm"}
    # Gemma's norm before the MLP is Llama's mlp_norm under its own name; its (1 + w) norms
    # start at w = 0.
    assert gemma["layers.mlp_norm"].hf_name == (
        "model.layers.{layer}.pre_feedforward_layernorm.weight")
    assert gemma["layers.post_attn_norm"].hf_name == (
        "model.layers.{layer}.post_attention_layernorm.weight")
    assert gemma["layers.post_mlp_norm"].gguf_name == "blk.{layer}.post_ffw_norm.weight"
    assert {s.init for s in gemma.values()} == {"normal", "zeros"}
    with pytest.raises(ValueError, match="family='gemma4' is not one of"):
        odd_config(family="gemma4")


def test_sliding_window_over_kv_shards_lays_out_on_every_attention_impl():
    """The kernels take a window over KV shards too (window_starts): no impl is refused."""
    config = odd_config(sliding_window=16)
    gemma = model_preset("tiny-gemma3")      # its sliding layers among full ones
    for impl in ("xla", "pallas", "interpret", "pallas-tpu", "interpret-tpu"):
        for parallel in (ParallelConfig(tp=2), ParallelConfig(kvp=2), ParallelConfig(cp=2)):
            for c in (config, gemma):
                MeshLayout.create(c, make_mesh(parallel), DEFAULT_RULES, impl)


@pytest.mark.parametrize("tp, replicas, padded_vocab", [(1, 1, 257), (2, 1, 258), (4, 2, 260),
                                                         (8, 4, 264)])
def test_layout_pads_vocab_and_repeats_kv_heads(tp, replicas, padded_vocab):
    config = odd_config()
    layout = MeshLayout.create(config, make_mesh(ParallelConfig(tp=tp)), DEFAULT_RULES, "xla")
    assert (layout.kv_head_replicas, layout.padded_vocab_size) == (replicas, padded_vocab)
    specs = param_specs(config)
    assert layout.placed_shape(specs["embed"]) == (padded_vocab, 32)
    assert layout.placed_shape(specs["layers.wk"]) == (2, 32, 2 * replicas, 8)
    for name, spec in specs.items():          # every placed shape divides its mesh axes
        layout.param_sharding(spec)


def test_lcm_repeats_when_neither_head_count_divides_the_other():
    config = odd_config(num_heads=24, num_kv_heads=6)
    layout = MeshLayout.create(config, make_mesh(ParallelConfig(tp=4)), DEFAULT_RULES, "xla")
    assert layout.kv_head_replicas == 2          # lcm(6, 4) / 6: 12 stored heads, 3 per device


def test_placed_reader_pads_and_repeats_any_slice():
    config = odd_config()
    layout = MeshLayout.create(config, make_mesh(ParallelConfig(tp=4)), DEFAULT_RULES, "xla")
    specs = param_specs(config)
    rng = np.random.default_rng(0)
    for name in ("embed", "lm_head", "layers.wk", "layers.wq"):
        spec = specs[name]
        canonical = rng.standard_normal(spec.shape).astype(np.float32)
        read = layout.placed_reader(spec, lambda index, a=canonical: a[index])
        whole = np.asarray(layout.expand(spec, canonical))
        assert whole.shape == layout.placed_shape(spec)
        np.testing.assert_array_equal(layout.canonical(spec, whole), canonical)
        for _ in range(20):       # random slices, as make_array_from_callback asks for them
            index = []
            for n in whole.shape:
                a, b = sorted(rng.integers(0, n + 1, 2))
                index.append(slice(int(a), int(b)))
            np.testing.assert_array_equal(read(tuple(index)), whole[tuple(index)], err_msg=name)


def test_rules_must_keep_kv_heads_with_their_query_heads():
    rules = LogicalRules(rules=(("heads", None), ("kv_heads", "tp")))
    with pytest.raises(ValueError, match="kv_heads -> 'tp' but heads -> None"):
        MeshLayout.create(odd_config(), make_mesh(ParallelConfig(tp=2)), rules, "xla")


def test_a_second_load_on_the_same_mesh_compiles_nothing_and_draws_the_same_weights():
    # Random weights are one program per (config, mesh layout, dtype), reused by every
    # later load: the suite loads "tiny" on the same few meshes hundreds of times.
    import jax

    from medha_jax import load_model
    from tests.test_engine import backend_compiles

    first = load_model("tiny", parallel=ParallelConfig(kvp=2, tp=2), verbose=False)
    with backend_compiles() as compiles:
        second = load_model("tiny", parallel=ParallelConfig(kvp=2, tp=2), verbose=False)
    assert compiles == []
    for a, b in zip(jax.tree.leaves(first.state), jax.tree.leaves(second.state)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
