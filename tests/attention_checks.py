"""The one comparison of attention results against an expected (out, lse), for the kernel tests."""

import numpy as np


def assert_attention_close(out, lse, want_out, want_lse, atol=2e-5):
    """out [T, H, D] and lse [T, H] equal the expected ones: no NaN, the same -inf rows
    (queries that saw no key), values within float32 tolerance."""
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, want_out, atol=atol, rtol=1e-4)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[finite], want_lse[finite], atol=atol, rtol=1e-5)
