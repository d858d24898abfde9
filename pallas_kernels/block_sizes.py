"""Tile sizes of the attention kernels: the `BlockSizes` type and a table of defaults per device.

`TILE_TABLE` holds one `TileDefaults` per device kind, each for the implementation "auto"
runs there (GPUs: the Pallas/Triton kernel; TPUs: the Mosaic-TPU kernel; CPUs: the XLA
path) plus "interpret" and "interpret-tpu" entries for the kernels in interpret mode. `device_kind_of` maps a `jax.Device` to a table key.
Choosing which entry an implementation uses is `dispatch.block_sizes_for`'s job.

The GPU and TPU entries follow from the hardware limits below and have not yet been timed
on the devices; `python -m benchmarks.kernels` on each is what would confirm or retune them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """How the attention work is tiled. Frozen and hashable: a static argument of jit.

    block_q:            query tokens per query block. A block never spans two sequences, so
                        a prefill chunk of c tokens is ceil(c / block_q) blocks. The kernel
                        folds the q_per_kv query heads of one KV head into the block's rows
                        (rows = block_q * q_per_kv), so one K/V tile feeds every head of its group.
    kv_pages_per_block: KV-cache pages per K/V tile of the inner (online-softmax) loop;
                        a tile holds kv_pages_per_block * page_size keys.
    num_kv_splits:      the kernel splits each query block's keys into this many contiguous
                        ranges processed by separate programs and merged by log-sum-exp
                        (split-K / flash-decoding), so a small chunk over a long context still
                        fills the device. decode_attention uses exactly this many; the ragged
                        kernel at most this many (fewer once its query blocks alone fill the
                        device). The XLA path and the TPU kernel ignore it.
    prefill_rows:       kernel rows a prefill query block should fill when the caller has
                        split decodes from prefill chunks (`attention.ragged_paged_attention`
                        with num_decodes): its block_q grows to prefill_rows // q_per_kv
                        tokens (`prefill_block_q`), so a long chunk reads each K/V tile
                        once per that many rows. 0: keep block_q.
    """

    block_q: int
    kv_pages_per_block: int
    num_kv_splits: int = 1
    prefill_rows: int = 0

    def __post_init__(self):
        if not isinstance(self.prefill_rows, int) or self.prefill_rows < 0:
            raise ValueError(f"BlockSizes.prefill_rows must be an int >= 0, got "
                             f"{self.prefill_rows!r}")
        for field in ("block_q", "kv_pages_per_block", "num_kv_splits"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"BlockSizes.{field} must be a positive int, got {value!r}")

    def block_kv(self, page_size: int) -> int:
        """Keys per K/V tile."""
        return self.kv_pages_per_block * page_size

    def prefill_block_q(self, q_per_kv: int, num_tokens: int) -> int:
        """Query tokens per block of the prefill path: enough to fill prefill_rows with the
        GQA group, never below block_q, and no more than the power of 2 >= num_tokens (a
        chunk is never longer than the step's token bucket); a power of 2 if block_q is."""
        want = max(self.block_q, self.prefill_rows // q_per_kv)
        want = 1 << (want - 1).bit_length() if _is_power_of_2(self.block_q) else want
        bound = 1 << (max(num_tokens, 1) - 1).bit_length()
        return max(self.block_q, min(want, bound))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TileDefaults:
    """One device kind's default tiling; keys per K/V tile depend on head_dim (a K and a V
    tile of head_dim 128 are twice the bytes and registers of head_dim 64)."""

    block_q: int
    keys_narrow: int  # keys per K/V tile for head_dim <= 64
    keys_wide: int    # keys per K/V tile for head_dim > 64
    num_kv_splits: int
    prefill_rows: int = 0

    def __post_init__(self):
        BlockSizes(block_q=self.block_q, kv_pages_per_block=1, num_kv_splits=self.num_kv_splits,
                   prefill_rows=self.prefill_rows)
        if min(self.keys_narrow, self.keys_wide) <= 0:
            raise ValueError(f"{self.keys_narrow=} and {self.keys_wide=} must be positive")

    def block_sizes(self, head_dim: int, page_size: int) -> BlockSizes:
        if head_dim <= 0 or page_size <= 0:
            raise ValueError(f"{head_dim=} and {page_size=} must be positive")
        keys = self.keys_narrow if head_dim <= 64 else self.keys_wide
        return BlockSizes(block_q=self.block_q, kv_pages_per_block=max(1, keys // page_size),
                          num_kv_splits=self.num_kv_splits, prefill_rows=self.prefill_rows)


TILE_TABLE: dict[str, TileDefaults] = {
    # XLA path (on every device; the table's other entries are the kernels'). On a CPU every
    # loop step is a sequential while-loop iteration with a fixed cost, so big tiles;
    # 64-token query blocks and 256-key tiles keep one step's score block at a few MB,
    # inside the caches (measured with benchmarks/kernels.py).
    "cpu": TileDefaults(block_q=64, keys_narrow=256, keys_wide=256, num_kv_splits=1),
    # The GPU kernel in interpret mode runs every grid program one after the other on the
    # CPU: the Triton layout (16-row blocks, power-of-2 tiles that pass check_native_tiles)
    # so the same tile shapes are exercised, but 2 KV splits, since splits only add
    # programs; prefill blocks of 32 rows so the prefill path's larger blocks are exercised.
    "interpret": TileDefaults(block_q=16, keys_narrow=64, keys_wide=64, num_kv_splits=2,
                              prefill_rows=32),
    # The TPU kernel in the TPU interpreter: the smallest legal tiles (8-token blocks,
    # 2 pages of 16 per tile) so small test contexts still span several tiles and DMAs.
    "interpret-tpu": TileDefaults(block_q=8, keys_narrow=32, keys_wide=32, num_kv_splits=1,
                                  prefill_rows=32),
    # A100: 108 SMs, 164 KB shared memory per SM, 4 warps per program. 16-token query
    # blocks (the smallest tl.dot M) times the GQA group fill the MMA rows; the
    # [rows, keys] f32 score tile and the [rows, head_dim] accumulator live in registers,
    # so head_dim 128 halves the keys (64: K+V bf16 tiles of 32 KB, 64 KB double-buffered,
    # two programs per SM). 8 splits give a decode batch of 8 sequences x 8 KV heads 512
    # programs, ~5 per SM. Prefill blocks of 64 rows: the register file of 4 warps holds a
    # 64 x 128 f32 accumulator and a 64 x 64 score tile.
    "a100": TileDefaults(block_q=16, keys_narrow=128, keys_wide=64, num_kv_splits=8,
                         prefill_rows=64),
    # H100 SXM: 132 SMs, 228 KB shared memory, 3.35 TB/s HBM3. The register budget per
    # program, not shared memory, bounds the tiles, so they are the A100's; decode is
    # bound by HBM and needs more loads in flight per byte/s, so 16 splits (8 seqs x 8 KV
    # heads -> 1024 programs, ~8 per SM; the ragged kernel caps splits at that too).
    # Prefill blocks of 128 rows (FlashAttention-2's BLOCK_M on Hopper; the kernel runs
    # 8 warps for them): 16 tokens x Llama-3 70B's GQA group of 8, so a chunk reads each
    # K/V tile once per 16 tokens at GQA 8 and once per 128 at GQA 1 (K/V bytes per FLOP
    # halve with each doubling; 128 x 64 tiles reach ~60% of dense-MMA peak in FA2).
    "h100": TileDefaults(block_q=16, keys_narrow=128, keys_wide=64, num_kv_splits=16,
                         prefill_rows=128),
    # H200: the H100's die (132 SMs, 228 KB) with 4.8 TB/s HBM3e: the same tiles; its
    # faster memory makes decode even more latency-bound per program, so the same 16 splits.
    "h200": TileDefaults(block_q=16, keys_narrow=128, keys_wide=64, num_kv_splits=16,
                         prefill_rows=128),
    # TPU v5e, the Mosaic kernel: one TensorCore, four 128x128 MXUs, 16 MB of scoped VMEM
    # by default, 819 GB/s HBM. 512-key tiles (4 x 128 lanes of scores) make each DMA
    # round carry 128 KB-256 KB of K+V per head, enough to hide the DMA latency behind
    # the previous tile's matmuls; 256-row prefill blocks (2 MXU passes) keep the
    # [256, 512] f32 scores (512 KB) plus K/V double buffers (~0.5 MB) far inside VMEM.
    # block_q 8 (a whole f32 sublane tile of rows per query head) for the decode path and
    # mixed batches. No KV splits: the grid is a sequential loop on one core.
    "tpu-v5e": TileDefaults(block_q=8, keys_narrow=512, keys_wide=512, num_kv_splits=1,
                            prefill_rows=256),
    # TPU v5p: the same MXUs, two cores per chip (megacore splits the "parallel" grid),
    # 2.76 TB/s HBM: 1024-key tiles halve the loop steps and DMA rounds of long contexts;
    # 512-row prefill blocks halve the K/V re-reads of a long chunk; the [512, 1024] f32
    # scores are 2 MB, with buffers ~4 MB, inside the default scoped VMEM.
    "tpu-v5p": TileDefaults(block_q=8, keys_narrow=1024, keys_wide=1024, num_kv_splits=1,
                            prefill_rows=512),
}
GPU_KINDS = ("a100", "h100", "h200")
TPU_KINDS = ("tpu-v5e", "tpu-v5p")
# Unknown devices get the smaller-memory kind of their family.
FALLBACK_KIND = {"gpu": "a100", "tpu": "tpu-v5e"}

# Substrings of jax.Device.device_kind (lower-cased) -> table key; first match wins.
# "NVIDIA GH200 480GB" holds an H200-class GPU and matches "h200".
_DEVICE_KIND_PATTERNS = (
    ("h200", "h200"), ("h100", "h100"), ("a100", "a100"),
    ("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"), ("v5p", "tpu-v5p"),
)


def device_kind_of(device: jax.Device | None = None) -> str:
    """The TILE_TABLE key of `device` (default: the first device of the default back-end).

    "NVIDIA H100 80GB HBM3" -> "h100", "TPU v5 lite" -> "tpu-v5e", any CPU -> "cpu". An
    unknown GPU or TPU falls back to FALLBACK_KIND for its family, with a warning logged
    once per device kind.
    """
    device = device if device is not None else jax.devices()[0]
    if device.platform == "cpu":
        return "cpu"
    return _kind_from_string(device.platform, device.device_kind)


@functools.lru_cache(maxsize=None)
def _kind_from_string(platform: str, device_kind: str) -> str:
    lowered = device_kind.lower()
    for pattern, kind in _DEVICE_KIND_PATTERNS:
        if pattern in lowered:
            return kind
    family = "tpu" if platform == "tpu" else "gpu"
    fallback = FALLBACK_KIND[family]
    logger.warning("no attention tiles for %s device kind %r; using the %r tiles",
                   platform, device_kind, fallback)
    return fallback


def _is_power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


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


def check_tpu_tiles(block_sizes: BlockSizes, *, page_size: int) -> None:
    """Mosaic layout constraints of the TPU kernel: a power-of-2 block_q >= 8 (query rows
    in whole sublane tiles, a row's token by bit-and) and pages of whole 8-row tiles."""
    block_q = block_sizes.block_q
    if block_q < 8 or not _is_power_of_2(block_q):
        raise ValueError(f"the TPU kernel needs a power-of-2 {block_q=} >= 8")
    if page_size % 8:
        raise ValueError(f"the TPU kernel needs {page_size=} a multiple of 8 (sublanes)")
