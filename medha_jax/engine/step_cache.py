"""Compiled steps kept on disk under a key computed without tracing the step.

JAX's persistent compilation cache keys an executable on its lowered HLO, so a warm start
still traces and lowers every step before it can look one up (1.9-3.5 s of SmolLM2's warm
start for its first shape). This cache keys a step on what determines its program instead:
the source of the packages that build it, the static arguments and the abstract arguments
(shapes, dtypes, shardings), the devices it runs on, and the jax / jaxlib versions and XLA
flags. A hit deserializes the executable (`jax.experimental.serialize_executable`) with no
trace. A Server keeps them in its cache directory (`steps/`, beside JAX's `xla/`); an Engine
built directly uses none unless given one (a test that patches the model's Python must
trace it). As with JAX's cache, whoever can write the directory can run code here (the
files are pickles).
"""

from __future__ import annotations

import functools
import hashlib
import marshal
import os
import pathlib
import pickle
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jaxlib

from medha_jax.engine.cache_dirs import CACHE_EVENTS

# The packages whose source builds a step's program (a change to any file re-keys it).
_PACKAGES = ("medha_jax", "pallas_kernels", "meshes")


@functools.cache
def _source_digest() -> str:
    """sha256 of every .py file of _PACKAGES (read once per process)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def code_digest(fn) -> str:
    """A digest of a (jitted) function's own code, for keys of programs it traces: a
    function swapped in at run time (a test's fault-injecting step) is another program."""
    fn = getattr(fn, "__wrapped__", fn)
    return hashlib.sha256(marshal.dumps(fn.__code__)).hexdigest()[:16]


def _describe(leaf) -> str:
    sharding = getattr(leaf, "sharding", None)
    return f"{getattr(leaf, 'shape', None)}:{getattr(leaf, 'dtype', type(leaf).__name__)}:" \
           f"{sharding}"


def step_key(name: str, static: object, args: Sequence, devices: Sequence) -> str:
    """The key of a program: `static` (its static arguments, by repr), the abstract `args`
    it is lowered for and the devices it runs on, with the code and toolchain versions."""
    leaves, tree = jax.tree.flatten(args)
    parts = [name, repr(static), str(tree), *map(_describe, leaves),
             ",".join(f"{d.platform}:{d.device_kind}:{d.id}" for d in devices),
             jax.__version__, jaxlib.__version__, os.environ.get("XLA_FLAGS", ""),
             str(jax.config.jax_enable_x64), str(jax.config.jax_default_matmul_precision),
             _source_digest(), _native_kernels(devices)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _native_kernels(devices: Sequence) -> str:
    """Which attention a CPU step calls: the native kernels (their library, by the digest
    of its source and build; registered with XLA here, before a step that calls them is
    loaded) or the XLA path. Other devices never call them."""
    if not any(d.platform == "cpu" for d in devices):
        return ""
    from pallas_kernels import cpu_native

    return cpu_native.status()


def load_or_compile(key: str, compile_: Callable[[], jax.stages.Compiled],
                    devices: Sequence, directory: str | os.PathLike | None
                    ) -> tuple[jax.stages.Compiled, float | None]:
    """(executable, the seconds its compile took when it came from disk, else None): the
    step saved under `key` in `directory`, else compile_()'s result, saved there (None:
    compiled, nothing kept). An unreadable entry is recompiled and overwritten."""
    from jax.experimental.serialize_executable import deserialize_and_load, serialize

    path = pathlib.Path(directory) / f"{key}.pkl" if directory is not None else None
    if path is not None and path.is_file():
        try:
            payload, in_tree, out_tree, seconds = pickle.loads(path.read_bytes())
            return deserialize_and_load(payload, in_tree, out_tree,
                                        execution_devices=list(devices)), seconds
        except Exception:           # a partial write or another jaxlib's: compile afresh
            pass
    # An executable JAX itself loaded from its persistent cache serializes without its
    # compiled functions on the CPU backend (jaxlib 0.10.2: running the copy fails with
    # "NOT_FOUND: Function ... not found"), and JAX's in-memory cache may hand that very
    # executable to a later compile of the same program in this process with no cache
    # event (a Server started again in one process: every step of its copies failed). So
    # only what XLA compiled in this call is kept. A step JAX's cache already holds
    # (compiled before this cache existed) is therefore never kept here: such a start
    # traces as before; clearing the cache directory ends that.
    CACHE_EVENTS.register()
    before = CACHE_EVENTS.thread_snapshot()
    start = time.perf_counter()
    executable = compile_()
    seconds = time.perf_counter() - start
    if path is not None and CACHE_EVENTS.compiled_here(before):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(pickle.dumps((*serialize(executable), seconds)))
            os.replace(tmp, path)      # whole or not at all, for a concurrent start
        except Exception:           # not serializable here (a backend without support)
            pass
    return executable, None
