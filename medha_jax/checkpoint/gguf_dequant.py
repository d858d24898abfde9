"""GGUF blocks -> float32, vectorised over whole tensors for llama.cpp's common types.

`gguf.quants.dequantize` walks a tensor in groups of rows from Python; for the block types
most GGUF chat models ship (Q4_0, Q4_1, Q8_0) one pass of numpy over every block of the
rows asked for does the same arithmetic, bit for bit, about 3x faster on SmolLM2-135M's
Q4_1 file (tests/test_gguf_dequant.py checks equality with gguf's on random blocks). Other
types go to gguf's.

Block layouts (ggml-common.h): QK = 32 weights per block.
    Q4_0: d (f16), 16 bytes of nibbles q     -> (q - 8) * d
    Q4_1: d (f16), m (f16), 16 bytes of q    -> q * d + m
    Q8_0: d (f16), 32 int8 q                  -> q * d
Nibbles: weight i < 16 is the low nibble of byte i, weight 16 + i its high nibble.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants

_BLOCK = 32


def _scale(blocks: np.ndarray, at: int) -> np.ndarray:
    """[blocks, 1] float32 of the f16 at byte `at` of each block."""
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[blocks, 16] uint8 -> [blocks, 32] float32: low nibbles, then high."""
    q = np.empty((packed.shape[0], _BLOCK), np.float32)
    q[:, :16] = packed & 0x0F
    q[:, 16:] = packed >> 4
    return q


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks[:, 2:])
    q -= 8
    q *= _scale(blocks, 0)
    return q


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks[:, 4:])
    q *= _scale(blocks, 0)
    q += _scale(blocks, 2)
    return q


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    return blocks[:, 2:].view(np.int8).astype(np.float32) * _scale(blocks, 0)


# type -> (bytes per block, block -> float32 [blocks, 32])
_VECTORISED = {GGMLQuantizationType.Q4_0: (18, _q4_0),
               GGMLQuantizationType.Q4_1: (20, _q4_1),
               GGMLQuantizationType.Q8_0: (34, _q8_0)}


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """uint8 [..., bytes per row] rows of `qtype` blocks (or a float tensor) -> float32
    [..., weights per row], as `gguf.quants.dequantize`."""
    if qtype not in _VECTORISED:
        return quants.dequantize(data, qtype)
    block_bytes, decode = _VECTORISED[qtype]
    rows, row_bytes = data.shape[:-1], data.shape[-1]
    if row_bytes % block_bytes:
        raise ValueError(f"a {qtype.name} row is whole blocks of {block_bytes} bytes, got "
                         f"{row_bytes}")
    blocks = np.ascontiguousarray(data).reshape(-1, block_bytes)
    return decode(blocks).reshape(*rows, row_bytes // block_bytes * _BLOCK)
