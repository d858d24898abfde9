"""Test setup: 8 virtual CPU devices, set before JAX is imported anywhere."""

import os

import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# The suite is bound by XLA:CPU compiles (tiny models, many shapes, several meshes), and
# most of a compile is LLVM's code generation: level 0 cuts a compile-bound test by about a
# quarter (the kv-parallel logits tests: 47 s -> 34 s) while run-bound ones keep their
# time (SmolLM2 greedy). The HLO passes, which the collective and schedule tests read, are
# unaffected. A level given in XLA_FLAGS wins.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Servers keep compiled executables and fitted predictors in a cache directory by default
# (medha_jax.engine.cache_dirs); the suite uses its own, fresh each run, so a test never
# depends on what an earlier run or the user's ~/.cache left behind.
if "MEDHA_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["MEDHA_CACHE_DIR"] = tempfile.mkdtemp(prefix="medha-test-cache-")



import jax  # noqa: E402  (after XLA_FLAGS: the devices are fixed when JAX starts)

# JAX's persistent cache as the suite started (no Server had pointed it anywhere yet).
SESSION_COMPILATION_CACHE_DIR = jax.config.jax_compilation_cache_dir


@pytest.fixture(autouse=True)
def jax_persistent_cache_only_where_a_server_set_it():
    """Each test ends with JAX's persistent compilation cache as the suite started.

    A Server points JAX's cache at its cache directory for the whole process
    (`cache_dirs.enable_compilation_cache`). Left that way, every later test of the worker
    writes its long compiles there, and that crashed workers (CPU backend, jaxlib 0.10.2):
    a segfault in `executable.serialize()` under tests/test_xla_attention.py, and one in
    the compile itself (`_compile_and_write_cache`) under tests/test_pipeline.py, after
    which pytest-xdist (--dist loadfile) hung until CI's time ran out. Restored to the
    session's value, not to the test's: a module-scoped Server is made before its module's
    first test starts, so "as the test found it" was already on. Servers and their steps
    still use the cache while the test that made them runs."""
    yield
    if jax.config.jax_compilation_cache_dir != SESSION_COMPILATION_CACHE_DIR:
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", SESSION_COMPILATION_CACHE_DIR)
        compilation_cache.reset_cache()


@pytest.fixture
def record_sessions(monkeypatch):
    """record_sessions(server) -> the list that collects the session_id of every request
    submitted to `server` from then on (the front ends' submit calls still go through)."""
    def install(server):
        sessions = []
        submit = server.submit

        def recording_submit(*args, session_id=None, **kwargs):
            sessions.append(session_id)
            return submit(*args, session_id=session_id, **kwargs)
        monkeypatch.setattr(server, "submit", recording_submit)
        return sessions
    return install
