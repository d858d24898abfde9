"""Test setup: 8 virtual CPU devices, set before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Servers keep compiled executables and fitted predictors in a cache directory by default
# (medha_jax.engine.cache_dirs); the suite uses its own, fresh each run, so a test never
# depends on what an earlier run or the user's ~/.cache left behind.
if "MEDHA_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["MEDHA_CACHE_DIR"] = tempfile.mkdtemp(prefix="medha-test-cache-")
