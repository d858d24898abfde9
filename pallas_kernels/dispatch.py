"""The one place that turns an attention implementation request into a concrete one.

    impl = resolve_impl("auto")                      # "pallas" on GPUs, "xla" elsewhere
    tiles = block_sizes_for(impl, device_kind_of(), head_dim=128, page_size=16)

Implementations: "xla" (plain jnp, `xla_attention`), "pallas" (the native kernel,
`paged_kernel`), "interpret" (the kernel in Pallas interpret mode, for tests), and
"auto". The public entry points (`attention.ragged_paged_attention`, `decode_attention`)
choose through `choose_attention`; the model resolves "auto" once at load time with
`resolve_impl` and says why with `describe_impl_choice`.
"""

from __future__ import annotations

import logging

import jax

from pallas_kernels.block_sizes import (GPU_KINDS, TILE_TABLE, BlockSizes, check_native_tiles,
                                        device_kind_of)

logger = logging.getLogger(__name__)

IMPLS = ("auto", "xla", "pallas", "interpret")
GPU_BACKENDS = ("gpu", "cuda", "rocm")


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"attention {impl=} must be one of {IMPLS}")


def _auto_impl(backend: str) -> str:
    # TPUs run the XLA path for now: the kernel gathers K/V pages with a vector of page ids,
    # which the Triton lowering supports and Mosaic-TPU does not (a TPU kernel would DMA
    # pages driven by scalar prefetch instead). Interpret mode is far too slow to serve.
    return "pallas" if backend in GPU_BACKENDS else "xla"


def resolve_impl(impl: str, backend: str | None = None) -> str:
    """"auto" -> "pallas" on GPUs, "xla" on CPUs and TPUs; others as asked, checked.

    For serving: "pallas" on a back-end without a GPU is an error here. (The entry points
    themselves accept an explicit "pallas" anywhere, so a kernel can be lowered for a GPU
    from a CPU host.)
    """
    _check_impl(impl)
    backend = backend or jax.default_backend()
    if impl == "auto":
        return _auto_impl(backend)
    if impl == "pallas" and backend not in GPU_BACKENDS:
        raise ValueError(f"attention impl 'pallas' needs a GPU; this back-end is {backend!r} "
                         "(use 'interpret' to run the kernel on the CPU, or 'xla')")
    return impl


def describe_impl_choice(requested: str, impl: str, backend: str) -> str:
    """One line for the load message: what runs attention, and why."""
    if requested != "auto":
        return f"{impl} (as asked)"
    why = "the Pallas kernel on GPUs" if impl == "pallas" else \
        f"the XLA path on {backend} (interpret mode is too slow to serve; no TPU kernel yet)"
    return f"{impl} (auto: {why})"


def block_sizes_for(impl: str, device_kind: str, head_dim: int, page_size: int) -> BlockSizes:
    """Default tiles of a concrete `impl` on a TILE_TABLE `device_kind` (`device_kind_of`).

    interpret: the "interpret" entry, on any device. pallas: the device's GPU entry; on a
    non-GPU device (lowering for a GPU from a CPU host) the H100's, logged. xla: the
    device's entry on CPUs and TPUs; on a GPU the CPU one, the only XLA-path tiling there
    is (GPU entries are the kernel's).
    """
    if impl not in IMPLS[1:]:
        raise ValueError(f"block_sizes_for wants a concrete impl {IMPLS[1:]}, got {impl=}")
    if device_kind not in TILE_TABLE:
        raise ValueError(f"{device_kind=} must be a TILE_TABLE key {tuple(TILE_TABLE)}")
    key = device_kind
    if impl == "interpret":
        key = "interpret"
    elif impl == "pallas" and device_kind not in GPU_KINDS:
        key = "h100"
        logger.info("Pallas kernel tiles for %r (not a GPU): using the %r ones",
                    device_kind, key)
    elif impl == "xla" and device_kind in GPU_KINDS:
        key = "cpu"
    return TILE_TABLE[key].block_sizes(head_dim, page_size)


def choose_attention(impl: str, block_sizes: BlockSizes | None, *, head_dim: int,
                     page_size: int) -> tuple[str, BlockSizes]:
    """What an entry point runs: the concrete impl and its tiles (given, or the defaults of
    the first device). "pallas" tiles are checked against the Triton constraints."""
    _check_impl(impl)
    if impl == "auto":
        impl = resolve_impl(impl)
    if block_sizes is None:
        block_sizes = block_sizes_for(impl, device_kind_of(), head_dim, page_size)
    if impl == "pallas":
        check_native_tiles(block_sizes, head_dim=head_dim, page_size=page_size)
    return impl, block_sizes
