"""The one place that turns an attention implementation request into a concrete one.

    impl = resolve_impl("auto")       # "pallas" on GPUs, "pallas-tpu" on TPUs, else "xla"
    tiles = block_sizes_for(impl, device_kind_of(), head_dim=128, page_size=16)

Implementations: "xla" (plain jnp, `xla_attention`), "pallas" (the GPU kernel,
`paged_kernel`, Triton), "interpret" (that kernel in Pallas interpret mode, for tests),
"pallas-tpu" (the Mosaic-TPU kernel, `tpu_paged_kernel`), "interpret-tpu" (that kernel
in the TPU interpreter, for tests: one device only, see tests/tpu_kernel_checks.py), and
"auto". The public entry points (`attention.ragged_paged_attention`, `decode_attention`)
choose through `choose_attention`; the model resolves "auto" once at load time with
`resolve_impl` and says why with `describe_impl_choice`.
"""

from __future__ import annotations

import logging

import jax

from pallas_kernels.block_sizes import (GPU_KINDS, TILE_TABLE, TPU_KINDS, BlockSizes,
                                        check_native_tiles, check_tpu_tiles, device_kind_of)

logger = logging.getLogger(__name__)

IMPLS = ("auto", "xla", "pallas", "interpret", "pallas-tpu", "interpret-tpu")
TPU_IMPLS = ("pallas-tpu", "interpret-tpu")   # the Mosaic-TPU kernel and its interpreter
GPU_BACKENDS = ("gpu", "cuda", "rocm")


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"attention {impl=} must be one of {IMPLS}")


def _auto_impl(backend: str) -> str:
    # GPUs: the Triton kernel (it gathers K/V pages with vectors of page ids); TPUs: the
    # Mosaic kernel (page ids by scalar prefetch, pages by DMA); CPUs: the XLA path, since
    # interpret modes are far too slow to serve.
    if backend in GPU_BACKENDS:
        return "pallas"
    return "pallas-tpu" if backend == "tpu" else "xla"


def resolve_impl(impl: str, backend: str | None = None) -> str:
    """"auto" -> "pallas" on GPUs, "pallas-tpu" on TPUs, "xla" on CPUs; others as asked,
    checked.

    For serving: "pallas" without a GPU, or "pallas-tpu" without a TPU, is an error here.
    (The entry points themselves accept either anywhere, so a kernel can be lowered for
    its device from a CPU host.)
    """
    _check_impl(impl)
    backend = backend or jax.default_backend()
    if impl == "auto":
        return _auto_impl(backend)
    if impl == "pallas" and backend not in GPU_BACKENDS:
        raise ValueError(f"attention impl 'pallas' needs a GPU; this back-end is {backend!r} "
                         "(use 'interpret' to run the kernel on the CPU, or 'xla')")
    if impl == "pallas-tpu" and backend != "tpu":
        raise ValueError(f"attention impl 'pallas-tpu' needs a TPU; this back-end is "
                         f"{backend!r} (use 'interpret-tpu' to run the kernel on the CPU)")
    return impl


def describe_impl_choice(requested: str, impl: str, backend: str) -> str:
    """One line for the load message: what runs attention, and why."""
    if requested != "auto":
        return f"{impl} (as asked)"
    why = {"pallas": "the Pallas kernel on GPUs",
           "pallas-tpu": "the Mosaic-TPU kernel on TPUs"}.get(
        impl, f"the XLA path on {backend} (interpret modes are too slow to serve)")
    return f"{impl} (auto: {why})"


def block_sizes_for(impl: str, device_kind: str, head_dim: int, page_size: int) -> BlockSizes:
    """Default tiles of a concrete `impl` on a TILE_TABLE `device_kind` (`device_kind_of`).

    interpret: the "interpret" entry, on any device. pallas: the device's GPU entry; on a
    non-GPU device (lowering for a GPU from a CPU host) the H100's, logged. pallas-tpu:
    the device's TPU entry; elsewhere the v5e's. interpret-tpu: the "interpret-tpu" entry.
    xla: the "cpu" entry on every device (on GPUs and TPUs the table's entries are the
    kernels').
    """
    if impl not in IMPLS[1:]:
        raise ValueError(f"block_sizes_for wants a concrete impl {IMPLS[1:]}, got {impl=}")
    if device_kind not in TILE_TABLE:
        raise ValueError(f"{device_kind=} must be a TILE_TABLE key {tuple(TILE_TABLE)}")
    key = device_kind
    if impl in ("interpret", "interpret-tpu"):
        key = impl
    elif impl == "pallas" and device_kind not in GPU_KINDS:
        key = "h100"
        logger.info("Pallas kernel tiles for %r (not a GPU): using the %r ones",
                    device_kind, key)
    elif impl == "pallas-tpu" and device_kind not in TPU_KINDS:
        key = "tpu-v5e"
        logger.info("TPU kernel tiles for %r (not a TPU): using the %r ones", device_kind, key)
    elif impl == "xla":
        key = "cpu"
    return TILE_TABLE[key].block_sizes(head_dim, page_size)


def prefill_query_block(impl: str, block_sizes: BlockSizes, *, q_per_kv: int,
                        num_tokens: int) -> int:
    """Query tokens per block that a prefill chunk pays on `impl`'s prefill path, in a step
    of num_tokens (padded) tokens whose decodes come first (the engine's steps): the
    kernels' prefill-sized blocks (`BlockSizes.prefill_block_q`, attention.py), the XLA
    path's block_q."""
    if impl == "xla":
        return block_sizes.block_q
    return block_sizes.prefill_block_q(q_per_kv, num_tokens)


def choose_attention(impl: str, block_sizes: BlockSizes | None, *, head_dim: int,
                     page_size: int) -> tuple[str, BlockSizes]:
    """What an entry point runs: the concrete impl and its tiles (given, or the defaults of
    the first device). "pallas" tiles are checked against the Triton constraints, TPU
    kernel tiles against Mosaic's."""
    _check_impl(impl)
    if impl == "auto":
        impl = resolve_impl(impl)
    if block_sizes is None:
        block_sizes = block_sizes_for(impl, device_kind_of(), head_dim, page_size)
    if impl == "pallas":
        check_native_tiles(block_sizes, head_dim=head_dim, page_size=page_size)
    if impl in TPU_IMPLS:
        check_tpu_tiles(block_sizes, page_size=page_size)
    return impl, block_sizes
