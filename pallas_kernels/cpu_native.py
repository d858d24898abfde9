"""Native CPU kernels: XLA FFI custom calls built from C++ with the machine's compiler.

    if cpu_native.available():
        out, lse = cpu_native.decode_attention(q, k_pages, v_pages, page_table, kv_lens,
                                               starts, sm_scale=0.125)

The XLA path (`xla_attention`) is exact and frugal with memory, but on the CPU a small
decode step spends most of its attention time in per-op costs of its loops: a lone SmolLM2
decode took ~23 ms of attention for ~18 MB of K/V, and 8 decodes ~50 of a ~125 ms step
(issue 26; `benchmarks/engine.py --breakdown`). Every jnp form of that loop was tried and
none was faster (README, "CPU decode"), so the decode attention is one custom call here,
`cpu_kernels.cc`, the issue's "custom call only if nothing else does"; so are a prefill
chunk's attention (XLA's query-block loops ran at ~20-50 GFLOP/s), the small steps' layer
matmuls (XLA copies each layer's slice of the stacked weights first) and their tied LM head.

The library is compiled on first use (about 7 s on 2 cores) against the running jaxlib's FFI headers
(`jax.ffi.include_dir()`) and kept beside its source, named by the digest of the source,
the jaxlib version and the compiler flags, so an edited source or another jaxlib builds
anew and never loads a stale one. Without a C++ compiler, where the build fails, or with
MEDHA_CPU_KERNELS=off, `available()` is False (the reason: `status()`) and callers keep the
XLA path: the results are the same to float rounding either way.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

logger = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("cpu_kernels.cc")
DECODE_ATTENTION_TARGET = "medha_cpu_decode_attention"
LAYER_MATMUL_TARGET = "medha_cpu_layer_matmul"
MATMUL_T_TARGET = "medha_cpu_matmul_t"
CHUNK_ATTENTION_TARGET = "medha_cpu_chunk_attention"
ENV_VAR = "MEDHA_CPU_KERNELS"       # "off" (or 0, false): the XLA path only
# -march=native: built on the machine that runs it, for its vector units.
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _library_path(compiler: str) -> pathlib.Path:
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join((compiler, *_FLAGS, jaxlib.__version__)).encode())
    return SOURCE.with_name(f"_cpu_kernels-{digest.hexdigest()[:16]}.so")


def _build(compiler: str, target: pathlib.Path) -> pathlib.Path:
    """Compiles SOURCE into `target` (atomically: concurrent builders, e.g. test workers,
    each write their own file and the last rename wins); into a temporary directory when
    the package directory is read-only."""
    directory = target.parent if os.access(target.parent, os.W_OK) else \
        pathlib.Path(tempfile.mkdtemp(prefix="medha-native-"))
    target = directory / target.name
    if target.exists():
        return target
    fd, partial = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE),
                        "-o", partial], check=True, capture_output=True, text=True,
                       timeout=300)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@functools.cache
def status() -> str:
    """"native <library name>" when the kernels are built and registered with XLA, else
    "off: <why>". Builds and registers them on the first call (once per process)."""
    if os.environ.get(ENV_VAR, "").strip().lower() in ("0", "off", "false", "no"):
        return f"off: {ENV_VAR}={os.environ[ENV_VAR]}"
    compiler = _compiler()
    if compiler is None:
        return "off: no C++ compiler (c++ or g++ on PATH, or $CXX)"
    try:
        path = _build(compiler, _library_path(compiler))
        library = ctypes.cdll.LoadLibrary(str(path))
        for target, symbol in ((DECODE_ATTENTION_TARGET, library.MedhaCpuDecodeAttention),
                               (LAYER_MATMUL_TARGET, library.MedhaCpuLayerMatmul),
                               (MATMUL_T_TARGET, library.MedhaCpuMatmulT),
                               (CHUNK_ATTENTION_TARGET, library.MedhaCpuChunkAttention)):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
    except (OSError, subprocess.SubprocessError, AttributeError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("medha-jax: the native CPU kernels did not build (%s); attention "
                       "keeps the XLA path", str(detail).strip()[:500])
        return f"off: build failed ({str(detail).strip()[:200]})"
    return f"native {path.name}"


def available() -> bool:
    """Whether the native CPU kernels can run in this process (building them if needed)."""
    return status().startswith("native")


def runs_on(*arrays) -> bool:
    """Whether a program traced now may call the native kernels on `arrays`: the default
    back-end is a CPU, they are f32, and the kernels built. (A step lowered for another
    device from a CPU host takes that device's kernels, never these.)"""
    return (jax.default_backend() == "cpu" and all(a.dtype == jnp.float32 for a in arrays)
            and available())


def decode_attention(q, k_pages, v_pages, page_table, kv_lens, starts, *, sm_scale: float):
    """`xla_attention.decode_attention_xla` as one custom call (f32; CPU only; needs
    `available()`).

    q [seqs, q_heads, head_dim]; k_pages, v_pages [num_pages, page_size, kv_heads * head_dim]
    (heads folded, `xla_attention._fold_heads`); page_table int32 [seqs, pages_per_seq];
    kv_lens, starts int32 [seqs]: the query sees keys starts .. kv_lens - 1.
    Returns out [seqs, q_heads, head_dim] f32 and lse [seqs, q_heads] f32 (0 / -inf where
    a query sees no key)."""
    seqs, q_heads, head_dim = q.shape
    call = jax.ffi.ffi_call(DECODE_ATTENTION_TARGET, (
        jax.ShapeDtypeStruct((seqs, q_heads, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((seqs, q_heads), jnp.float32)))
    return call(q.astype(jnp.float32), k_pages, v_pages, page_table.astype(jnp.int32),
                kv_lens.astype(jnp.int32), starts.astype(jnp.int32),
                sm_scale=np.float32(sm_scale))


def chunk_attention(q, k_pages, v_pages, page_table, cu_q_lens, num_seqs, starts, ends, *,
                    sm_scale: float):
    """The prefill chunks' attention of a ragged batch as one custom call (f32; CPU only;
    needs `available()`; head_dim a multiple of 8, at most 256).

    q [tokens, q_heads, head_dim]; k_pages, v_pages [num_pages, page_size, kv_heads *
    head_dim] (heads folded); page_table int32 [max_seqs, pages_per_seq]; cu_q_lens int32
    [max_seqs + 1]; num_seqs int32 [1]; starts, ends int32 [tokens]: query t sees keys
    starts[t] .. ends[t] - 1 of its sequence. Only sequences of 2 or more queries (chunks)
    are computed: the rows of decodes and padding are 0 / -inf.
    Returns out [tokens, q_heads, head_dim] f32 and lse [tokens, q_heads] f32."""
    tokens, q_heads, head_dim = q.shape
    call = jax.ffi.ffi_call(CHUNK_ATTENTION_TARGET, (
        jax.ShapeDtypeStruct((tokens, q_heads, head_dim), jnp.float32),
        jax.ShapeDtypeStruct((tokens, q_heads), jnp.float32)))
    with jax.named_scope("chunk_attention"):   # "attention", in a step breakdown's op names
        return call(q.astype(jnp.float32), k_pages, v_pages, page_table.astype(jnp.int32),
                    cu_q_lens.astype(jnp.int32), num_seqs.astype(jnp.int32),
                    starts.astype(jnp.int32), ends.astype(jnp.int32),
                    sm_scale=np.float32(sm_scale))


def layer_matmul(x, stacked, layer):
    """x [rows, k] @ stacked[layer] ([layers, k, n], n a multiple of 32; f32) -> [rows, n]
    f32, the layer's matrix read in place (CPU only; needs `available()`).

    For a few rows (a decode step's tokens) it streams the matrix front to back (k split
    over the pool's threads, the partial products summed in a fixed order); past 8 rows a
    packed GEMM."""
    call = jax.ffi.ffi_call(LAYER_MATMUL_TARGET, jax.ShapeDtypeStruct(
        (x.shape[0], stacked.shape[2]), jnp.float32))
    with jax.named_scope("layer_matmul"):      # in the op names a step breakdown reads
        return call(x.astype(jnp.float32), stacked, jnp.asarray(layer, jnp.int32))


def matmul_t(x, w):
    """x [rows, k] @ w.T, w [n, k] (f32) -> [rows, n] f32: a tied LM head read row by row
    where it lies (CPU only; needs `available()`). For a few rows."""
    call = jax.ffi.ffi_call(MATMUL_T_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]),
                                                                  jnp.float32))
    with jax.named_scope("sd,dv->sv"):        # the LM head, in a step breakdown's op names
        return call(x.astype(jnp.float32), w)
