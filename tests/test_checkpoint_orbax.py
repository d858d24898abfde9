"""Orbax save/restore of sharded parameters: values, shapes, dtypes and shardings survive."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from medha_jax.checkpoint import CheckpointError, restore_params, save_params
from medha_jax.config import model_preset


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:2])


@pytest.fixture(scope="module")
def saved(mesh, tmp_path_factory):
    rng = np.random.default_rng(0)
    specs = {"embed": P("x", None), "layers.wq": P(None, None, "x", None),
             "final_norm": P(), "layers.w_down": P(None, "x", None)}
    shapes = {"embed": (16, 8), "layers.wq": (2, 8, 4, 2), "final_norm": (8,),
              "layers.w_down": (2, 6, 8)}
    params = {name: jax.device_put(rng.standard_normal(shapes[name]).astype(np.float32),
                                   NamedSharding(mesh, specs[name]))
              for name in shapes}
    params["layers.w_down"] = params["layers.w_down"].astype(jnp.bfloat16)
    path = tmp_path_factory.mktemp("orbax") / "ckpt"
    config = model_preset("tiny")   # has a RopeScaling, which must round-trip too
    save_params(path, params, config)
    return path, params, config


def test_round_trip_preserves_values_shapes_dtypes_and_shardings(saved):
    path, params, config = saved
    restored_config, restored = restore_params(path, {k: v.sharding for k, v in params.items()})
    assert restored_config == config
    assert set(restored) == set(params)
    for name, want in params.items():
        got = restored[name]
        assert (got.shape, got.dtype) == (want.shape, want.dtype), name
        assert got.sharding == want.sharding, name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)


def test_restore_into_another_sharding_or_one_device(saved, mesh):
    path, params, _ = saved
    other = {name: NamedSharding(mesh, P()) for name in params}
    other["embed"] = NamedSharding(mesh, P(None, "x"))
    _, resharded = restore_params(path, other)
    _, single = restore_params(path)
    for name, want in params.items():
        assert resharded[name].sharding == other[name], name
        assert single[name].sharding.device_set == {jax.local_devices()[0]}, name
        np.testing.assert_array_equal(np.asarray(resharded[name]), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(single[name]), np.asarray(want))


def test_errors(saved, tmp_path):
    path, params, config = saved
    with pytest.raises(FileExistsError, match="not empty"):
        save_params(path, params, config)
    with pytest.raises(ValueError, match=r"missing=\['final_norm'\]"):
        restore_params(path, {k: v.sharding for k, v in params.items() if k != "final_norm"})
    with pytest.raises(CheckpointError, match="model_config.json"):
        restore_params(tmp_path)
