"""The Mosaic-TPU kernel's checks (tests/tpu_kernel_checks.py), run in a child pytest
with one CPU device: the TPU interpreter hangs with the 8 virtual devices this suite's
conftest sets up, and the device count is fixed once JAX starts. --noconftest keeps the
child from re-adding them; the child's own failures are printed here."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_checks(marker: str):
    # Compiles of the interpreter's programs are most of the child's time and their run
    # time is Python callbacks, so XLA's backend optimisations buy nothing here: off
    # (about a third less CPU time).
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1 "
                         "--xla_backend_optimization_level=0",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider",
         "-m", marker, str(ROOT / "tests" / "tpu_kernel_checks.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and " failed" not in result.stdout


def test_tpu_kernel_in_the_interpreter():
    """Dense oracle on hypothesis-drawn ragged batches for every shape (causal on both
    paths, prefix on the split), bf16 on both paths, decode_attention, a long chunk over a
    full table; decodes served by the decode path in one-token blocks."""
    run_checks("not slow")


@pytest.mark.slow
def test_tpu_kernel_against_jax_and_race_detector():
    """JAX's reference semantics as a second oracle; the DMA race detector; JAX's own TPU
    kernel (a strict xfail while the interpreter cannot run it)."""
    run_checks("slow")
