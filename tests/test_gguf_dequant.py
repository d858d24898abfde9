"""The vectorised GGUF dequantizer against gguf's own, bit for bit, on fresh random blocks."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from medha_jax.checkpoint.gguf_dequant import dequantize

BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}


def random_rows(rng, qtype, rows, blocks_per_row):
    """Random blocks whose f16 scales are finite (random bytes there could be inf / nan)."""
    data = rng.integers(0, 256, size=(rows, blocks_per_row, BLOCK_BYTES[qtype]), dtype=np.uint8)
    scales = 2 if qtype == Q.Q4_1 else 1
    f16 = rng.normal(0, 0.05, size=(rows, blocks_per_row, scales)).astype(np.float16)
    data[..., :2 * scales] = f16.view(np.uint8).reshape(rows, blocks_per_row, 2 * scales)
    return data.reshape(rows, blocks_per_row * BLOCK_BYTES[qtype])


@pytest.mark.parametrize("qtype", sorted(BLOCK_BYTES, key=lambda t: t.value))
def test_equals_gguf_on_random_blocks(qtype):
    rng = np.random.default_rng()
    for rows, blocks in [(1, 1), (7, 3), (64, 12)]:
        data = random_rows(rng, qtype, rows, blocks)
        want = quants.dequantize(data, qtype)
        got = dequantize(data, qtype)
        assert got.dtype == np.float32 and got.shape == want.shape == (rows, 32 * blocks)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(dequantize(data[2:5], qtype), want[2:5])   # a row slice


def test_other_types_go_to_gguf_and_bad_rows_are_refused():
    floats = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(dequantize(floats, Q.F32), floats)
    with pytest.raises(ValueError, match="Q4_1 row is whole blocks of 20 bytes"):
        dequantize(np.zeros((2, 30), np.uint8), Q.Q4_1)
