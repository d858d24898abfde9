"""Test setup: 8 virtual CPU devices, set before JAX is imported anywhere."""

import gc
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


# The suite is two thirds XLA:CPU compiles, and its modules compile many of the same
# programs (the tiny models' steps on the same meshes; a module's are dropped when it ends,
# compiled_code_released_after_each_module). One persistent compilation cache for the whole
# run, fresh each run, shared by the xdist workers (they inherit it from the process that
# starts them, which imports this first) and the processes they start (multi-process and Ray
# tests): a program compiled once is read back by every later test that needs it. Every
# compile is kept (min time 0): most of the suite's are under JAX's default of 1 s. What a
# test checks does not change: a read from the cache fires the backend-compile event that
# the no-compile-after-warm-up guards count, and a Server with a cache of its own points
# JAX there while it lives (restored after each test, below).
RUN_COMPILATION_CACHE_DIR = None        # made by this process: removed when the run ends
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    RUN_COMPILATION_CACHE_DIR = tempfile.mkdtemp(prefix="medha-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = RUN_COMPILATION_CACHE_DIR
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402  (after XLA_FLAGS: the devices are fixed when JAX starts)

# JAX's persistent cache as the suite started: the run's own (above), or the one given.
SESSION_COMPILATION_CACHE_DIR = jax.config.jax_compilation_cache_dir


def pytest_unconfigure(config):
    if RUN_COMPILATION_CACHE_DIR is not None:          # after the workers have ended
        import shutil

        shutil.rmtree(RUN_COMPILATION_CACHE_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def jax_persistent_cache_only_where_a_server_set_it():
    """Each test ends with JAX's persistent compilation cache as the suite started.

    A Server points JAX's cache at its cache directory for the whole process
    (`cache_dirs.enable_compilation_cache`). Left that way, every later test of the worker
    would write its compiles into that Server's cache, and a test that counts a cold
    Server's cache hits would depend on which module ran before it on the worker.
    Restored to the session's value, not to the test's: a module-scoped Server is made
    before its module's first test starts, so "as the test found it" was already on.
    Servers and their steps still use their cache while the test that made them runs."""
    yield
    if jax.config.jax_compilation_cache_dir != SESSION_COMPILATION_CACHE_DIR:
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", SESSION_COMPILATION_CACHE_DIR)
        compilation_cache.reset_cache()


@pytest.fixture(autouse=True, scope="module")
def compiled_code_released_after_each_module():
    """Drops JAX's compiled executables when a test module ends (after its own fixtures).

    Every XLA:CPU executable maps its JIT code as ~3 memory regions, held as long as the
    executable lives, and jit caches (module-level jits included) hold every executable
    compiled through them. A pytest worker runs ~60 modules: without this, a worker's map
    count grew past 15,000 by a quarter of the suite, and Linux refuses mappings past
    vm.max_map_count (65,530 by default), which LLVM's JIT takes as a crash. The suite's
    segfaults inside XLA's compile and `executable.serialize()`, late in long workers (CI
    and fresh clones here), were that. Modules recompile what they use anyway (their own
    shapes and meshes)."""
    yield
    jax.clear_caches()
    gc.collect()
    regions = mapped_regions()
    if regions > MAPPED_REGIONS_ALARM:
        pytest.fail(f"this worker holds {regions:,} memory mappings after the module's "
                    f"caches were cleared (Linux's default limit is 65,530, past which "
                    f"XLA crashes): something keeps compiled executables alive, e.g. a "
                    f"Server that was never closed", pytrace=False)


# Well under vm.max_map_count's default: a leak is named here before XLA crashes on it.
MAPPED_REGIONS_ALARM = 40_000


def mapped_regions() -> int:
    """The process's memory mappings (lines of /proc/self/maps); 0 where there is no /proc."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return 0


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
