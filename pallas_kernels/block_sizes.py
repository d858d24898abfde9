"""Tile sizes of the attention kernels, and the one place that picks them per back-end.

`resolve(impl, block_sizes, ...)` is the only function that looks at the back-end: every
public attention entry point calls it to turn "auto" into a concrete implementation and
a missing `BlockSizes` into the default for that implementation.
"""

from __future__ import annotations

import dataclasses

import jax

IMPLS = ("auto", "reference", "pallas", "interpret")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """How the attention work is tiled. Frozen and hashable: a static argument of jit.

    block_q:            query tokens per query block. A block never spans two sequences, so
                        a prefill chunk of c tokens is ceil(c / block_q) blocks. The kernels
                        fold the q_per_kv query heads of one KV head into the block's rows
                        (rows = block_q * q_per_kv), so one K/V tile feeds every head of its group.
    kv_pages_per_block: KV-cache pages per K/V tile of the inner (online-softmax) loop;
                        a tile holds kv_pages_per_block * page_size keys.
    num_kv_splits:      the kernels split each query block's keys into this many contiguous
                        ranges processed by separate programs and merged by log-sum-exp
                        (split-K / flash-decoding), so a small chunk over a long context still
                        fills the device. decode_attention uses exactly this many; the ragged
                        kernel at most this many (fewer once its query blocks alone fill the
                        device). The references run on one CPU stream and ignore it.
    """

    block_q: int
    kv_pages_per_block: int
    num_kv_splits: int = 1

    def __post_init__(self):
        for field in ("block_q", "kv_pages_per_block", "num_kv_splits"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"BlockSizes.{field} must be a positive int, got {value!r}")

    def block_kv(self, page_size: int) -> int:
        """Keys per K/V tile."""
        return self.kv_pages_per_block * page_size


def _is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def default_block_sizes(backend: str, head_dim: int, page_size: int) -> BlockSizes:
    """The tiling for `backend` ("cpu", "gpu", "tpu"; "interpret" uses the gpu tiling).

    cpu (the jnp references): big tiles, because every loop step is a sequential XLA
    while-loop iteration with a fixed cost; 64-token query blocks and ~256-key tiles keep
    the score block of one step at a few MB (measured with benchmarks/kernels.py).
    gpu (the Triton kernel): 16-token query blocks (the smallest tl.dot M) times the GQA
    group fill the MMA rows; 64-128 key tiles keep the [rows, keys] score tile in registers
    (smaller for head_dim 128, where K and V tiles are twice as large); 8 KV splits give
    a decode or a small chunk over a long context enough programs to fill the SMs.
    """
    if head_dim <= 0 or page_size <= 0:
        raise ValueError(f"{head_dim=} and {page_size=} must be positive")
    if backend == "cpu":
        return BlockSizes(block_q=64, kv_pages_per_block=max(1, 256 // page_size),
                          num_kv_splits=1)
    if backend in ("gpu", "cuda", "rocm", "interpret"):
        keys = 64 if head_dim >= 128 else 128
        pages = max(1, keys // page_size)
        return BlockSizes(block_q=16, kv_pages_per_block=pages, num_kv_splits=8)
    if backend == "tpu":
        # The TPU path runs the reference (see `resolve`); tile it like the CPU one but
        # with the larger on-chip memory in mind.
        return BlockSizes(block_q=128, kv_pages_per_block=max(1, 512 // page_size),
                          num_kv_splits=1)
    raise ValueError(f"no default block sizes for {backend=}; expected cpu, gpu or tpu")


def resolve(impl: str, block_sizes: BlockSizes | None, *, head_dim: int,
            page_size: int) -> tuple[str, BlockSizes]:
    """Turns ("auto" | "reference" | "pallas" | "interpret", maybe-None tiles) into concrete ones.

    auto: the native Pallas kernel on GPUs; the jnp reference on CPUs (interpret mode is
    far too slow to serve) and on TPUs. The TPU deviation is deliberate: our kernel gathers
    K/V pages with a vector of page ids inside the kernel, which the Triton lowering supports
    and Mosaic-TPU does not (a TPU kernel would DMA pages driven by scalar prefetch instead).
    """
    if impl not in IMPLS:
        raise ValueError(f"{impl=} must be one of {IMPLS}")
    backend = jax.default_backend()
    if impl == "auto":
        impl = "pallas" if backend in ("gpu", "cuda", "rocm") else "reference"
    if block_sizes is None:
        tiling_for = {"reference": backend, "interpret": "interpret", "pallas": "gpu"}[impl]
        block_sizes = default_block_sizes(tiling_for, head_dim, page_size)
    if impl == "pallas":
        check_native_tiles(block_sizes, head_dim=head_dim, page_size=page_size)
    return impl, block_sizes


def check_native_tiles(block_sizes: BlockSizes, *, head_dim: int, page_size: int) -> None:
    """The Triton lowering needs power-of-2 tensors and tl.dot needs every side >= 16."""
    block_kv = block_sizes.block_kv(page_size)
    if not (_is_power_of_2(head_dim) and head_dim >= 16):
        raise ValueError(f"native Pallas needs a power-of-2 {head_dim=} >= 16")
    if not (_is_power_of_2(page_size) and _is_power_of_2(block_sizes.kv_pages_per_block)):
        raise ValueError(
            f"native Pallas needs power-of-2 {page_size=} and "
            f"kv_pages_per_block={block_sizes.kv_pages_per_block}")
    if block_kv < 16:
        raise ValueError(f"native Pallas needs {block_kv=} (pages x page_size) >= 16")



# The jnp decode reference gathers one K/V tile of every sequence per loop step. Past a
# few MB the gathered tile no longer stays in the CPU's cache and the step turns into
# two extra trips through memory: at 64 sequences x 2K context (smollm2 heads, f32) the
# step time falls from 113 ms with 16-page tiles to 58 ms with 2-4 pages (benchmarks/kernels.py).
REFERENCE_DECODE_TILE_BYTES = 4 * 2**20


def reference_decode_pages_per_tile(block_sizes: BlockSizes, *, seqs: int, page_size: int,
                                    kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Pages per step of the decode reference: block_sizes.kv_pages_per_block, fewer when
    the K tile of all `seqs` sequences together would pass REFERENCE_DECODE_TILE_BYTES."""
    page_bytes = seqs * page_size * kv_heads * head_dim * itemsize
    return max(1, min(block_sizes.kv_pages_per_block, REFERENCE_DECODE_TILE_BYTES // page_bytes))
