"""The one place that turns an attention implementation request into a concrete one.

(Provisional version written by the lead so the tree imports; the kernels helper owns this
file and may extend it, keeping `resolve_impl` and `describe_impl_choice`.)
"""

from __future__ import annotations

import jax

IMPLS = ("auto", "xla", "pallas", "interpret")
_GPU_BACKENDS = ("gpu", "cuda", "rocm")


def resolve_impl(impl: str, backend: str | None = None) -> str:
    """"auto" -> "pallas" on GPUs, "xla" (the jnp path) elsewhere; others as asked."""
    if impl not in IMPLS:
        raise ValueError(f"attention {impl=} must be one of {IMPLS}")
    backend = backend or jax.default_backend()
    if impl == "auto":
        impl = "pallas" if backend in _GPU_BACKENDS else "xla"
    # Provisional: the kernels still call the XLA path "reference" until they are renamed.
    if impl == "xla":
        return "reference"
    if impl == "pallas" and backend not in _GPU_BACKENDS:
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
