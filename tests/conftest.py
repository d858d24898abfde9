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
