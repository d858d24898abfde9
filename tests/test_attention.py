"""The model's attention entry point: the Pallas kernel per device on sharded meshes."""

import numpy as np
import pytest

from medha_jax import ParallelConfig, load_model


@pytest.fixture(scope="module")
def one_device_logits():
    ids = np.random.default_rng(0).integers(0, 256, 30).tolist()
    return ids, load_model("tiny").logits(ids)


@pytest.mark.parametrize("parallel", [ParallelConfig(tp=2), ParallelConfig(kvp=2, tp=2),
                                      ParallelConfig(tp=4)], ids=str)
def test_pallas_kernel_under_shard_map_matches_one_device(one_device_logits, parallel):
    # tiny has 8 query heads and 2 K/V heads: tp=2 splits both (shard_map path), tp=4
    # replicates K/V heads (the GSPMD reference path).
    ids, expected = one_device_logits
    model = load_model("tiny", parallel=parallel)
    np.testing.assert_allclose(model.logits(ids, attention_impl="interpret"), expected,
                               atol=2e-5, rtol=0)
