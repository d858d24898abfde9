"""sample(): greedy, top-k, top-p, the sampled distribution, and per-row independence."""

import jax
import numpy as np
import pytest

from medha_jax.engine.sampler import sample

sample_jit = jax.jit(sample)


def _params(num_rows, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    rng = np.random.default_rng(seed)
    return (np.full(num_rows, temperature, np.float32), np.full(num_rows, top_k, np.int32),
            np.full(num_rows, top_p, np.float32),
            rng.integers(0, 2**32, (num_rows, 2), dtype=np.uint64).astype(np.uint32))


def _logits(num_rows, vocab_size, seed=0):
    return np.random.default_rng(seed).normal(0, 3, (num_rows, vocab_size)).astype(np.float32)


def _expected_distribution(logits, temperature, top_k, top_p):
    """softmax(logits / T) restricted to top-k, then to the top-p nucleus, renormalised."""
    probs = np.exp((logits - logits.max()) / temperature)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    kept = np.zeros_like(probs, bool)
    k = top_k or len(probs)
    top = probs[order[:k]] / probs[order[:k]].sum()
    mass_before = np.cumsum(top) - top
    kept[order[:k][mass_before < top_p]] = True
    restricted = np.where(kept, probs, 0)
    return restricted / restricted.sum()


def test_temperature_zero_is_argmax_whatever_the_filters():
    logits = _logits(16, 50)
    temperature, _, _, keys = _params(16, temperature=0.0)
    rng = np.random.default_rng(1)
    top_k = rng.integers(0, 10, 16).astype(np.int32)
    top_p = rng.uniform(0.1, 1.0, 16).astype(np.float32)
    tokens = sample_jit(logits, temperature, top_k, top_p, keys)
    assert tokens.dtype == np.int32 and tokens.shape == (16,)
    np.testing.assert_array_equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 7.0])
def test_top_k_one_and_tiny_top_p_are_argmax(temperature):
    logits = _logits(16, 50, seed=2)
    t, k, p, keys = _params(16, temperature=temperature, top_k=1)
    np.testing.assert_array_equal(sample_jit(logits, t, k, p, keys), logits.argmax(-1))
    t, k, p, keys = _params(16, temperature=temperature, top_p=1e-6)
    np.testing.assert_array_equal(sample_jit(logits, t, k, p, keys), logits.argmax(-1))


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (1.0, 0, 1.0),      # plain softmax
    (0.7, 3, 1.0),      # top-k
    (1.5, 0, 0.8),      # nucleus
    (1.0, 4, 0.7),      # top-k, then nucleus on the renormalised top 4
])
def test_sampled_distribution_matches_filtered_softmax(temperature, top_k, top_p):
    row = np.array([2.0, 1.5, 1.0, 0.4, 0.0, -0.5, -1.2, 3.0], np.float32)
    num_samples = 40_000
    logits = np.tile(row, (num_samples, 1))
    t, k, p, keys = _params(num_samples, temperature, top_k, top_p, seed=3)
    tokens = np.asarray(sample_jit(logits, t, k, p, keys))
    empirical = np.bincount(tokens, minlength=len(row)) / num_samples
    expected = _expected_distribution(row, temperature, top_k, top_p)
    assert np.all(empirical[expected == 0] == 0), (empirical, expected)
    total_variation = 0.5 * np.abs(empirical - expected).sum()
    # The sampling noise of 40k draws over 8 tokens is ~0.005 in total variation.
    assert total_variation < 0.02, (total_variation, empirical, expected)


def test_row_depends_only_on_its_own_logits_params_and_key():
    num_rows, vocab_size = 64, 40
    logits = _logits(num_rows, vocab_size, seed=4) / 3     # flatter: many plausible tokens
    rng = np.random.default_rng(5)
    temperature = rng.choice([0.0, 0.5, 1.0, 2.0], num_rows).astype(np.float32)
    top_k = rng.choice([0, 0, 1, 5, 20], num_rows).astype(np.int32)
    top_p = rng.choice([1.0, 1.0, 0.5, 0.9], num_rows).astype(np.float32)
    keys = rng.integers(0, 2**32, (num_rows, 2), dtype=np.uint64).astype(np.uint32)
    tokens = np.asarray(sample_jit(logits, temperature, top_k, top_p, keys))

    perm = rng.permutation(num_rows)
    permuted = sample_jit(logits[perm], temperature[perm], top_k[perm], top_p[perm], keys[perm])
    np.testing.assert_array_equal(permuted, tokens[perm])

    # Unfiltered rows give the same tokens when no row of the batch filters (no sort).
    plain = (top_k == 0) & (top_p == 1)
    alone = sample_jit(logits[plain], temperature[plain], top_k[plain], top_p[plain], keys[plain])
    np.testing.assert_array_equal(alone, tokens[plain])

    # Same keys, same tokens; new keys move the sampled rows.
    again = sample_jit(logits, temperature, top_k, top_p, keys)
    np.testing.assert_array_equal(again, tokens)
    moved = np.asarray(sample_jit(logits, temperature, top_k, top_p, keys ^ np.uint32(1)))
    random_rows = (temperature > 0) & (top_k != 1)
    assert (moved[random_rows] != tokens[random_rows]).sum() > random_rows.sum() // 4
    np.testing.assert_array_equal(moved[temperature == 0], tokens[temperature == 0])
