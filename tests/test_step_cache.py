"""The engine's on-disk step cache: a second engine of the same key loads its steps without
tracing them and computes the same tokens; a different program is another key."""

import dataclasses

import jax
import pytest

from medha_jax.engine import Engine, EngineConfig, step_cache
from medha_jax.engine import engine as engine_module
from serving.replicas import replica_models
from tests.test_switching import WHOLE, drive, prompt, request

CFG = EngineConfig(page_size=16, max_kv_tokens=256, max_model_len=256, max_tokens_per_step=32,
                   min_token_bucket=16, max_seqs=4, enable_prefix_caching=False)


@pytest.fixture(autouse=True)
def without_jax_cache():
    """JAX's persistent cache off and its in-memory caches cleared: a step JAX hands back
    from either is not kept (step_cache says why), and earlier tests of a suite may have
    put these very programs in both (CI: an earlier test of the same worker process had
    compiled one of the two steps, so only the other was kept)."""
    from jax.experimental.compilation_cache import compilation_cache

    # jax 0.11 decides once per process whether its persistent cache is in use (the first
    # compile asks): turning the flag off after that still hit the cache (3 hits in a
    # script, 0 on jax 0.10.2); a reset makes it ask again.
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    jax.clear_caches()
    yield
    jax.config.update("jax_enable_compilation_cache", before)
    compilation_cache.reset_cache()


def tokens(engine, seed):
    return drive(engine, [(0, request("r", prompt(seed, 20), 4))], rng=None, max_chunk=0,
                 chunk_of=WHOLE)["r"]


def test_a_second_engine_loads_its_steps_untraced_with_the_same_tokens(tmp_path, monkeypatch):
    model = replica_models("tiny", 1)[0]
    first = Engine(model, CFG, step_cache_dir=tmp_path)
    first.warmup(progress=False)
    assert first.steps_loaded == 0
    saved = sorted(tmp_path.glob("*.pkl"))
    assert len(saved) == len(first.ladder.all_shapes())
    expected = tokens(first, 1)

    def no_trace(*args, **kwargs):
        raise AssertionError("a cached step was traced")

    monkeypatch.setattr(engine_module.step, "lower", no_trace)
    second = Engine(model, CFG, step_cache_dir=tmp_path)
    second.warmup(progress=False)
    assert second.steps_loaded == len(saved) and second.step_seconds_saved > 0
    assert tokens(second, 1) == expected
    # Another engine config is another program: it compiles (and here, fails to trace).
    with pytest.raises(AssertionError, match="traced"):
        Engine(model, dataclasses.replace(CFG, max_seqs=2),
               step_cache_dir=tmp_path).warmup(progress=False)
    # Without a directory nothing is read: the engine traces (a patched model must).
    with pytest.raises(AssertionError, match="traced"):
        Engine(model, CFG).warmup(progress=False)


def test_keys_name_the_program():
    devices = jax.devices()[:1]
    args = (jax.ShapeDtypeStruct((4, 8), "float32"),)
    key = step_cache.step_key("s", (1,), args, devices)
    assert key == step_cache.step_key("s", (1,), args, devices)
    assert key != step_cache.step_key("s", (2,), args, devices)
    assert key != step_cache.step_key("s", (1,), (jax.ShapeDtypeStruct((4, 8), "bfloat16"),),
                                      devices)
    assert key != step_cache.step_key("s", (1,), args, jax.devices()[1:2])


def test_a_tp_groups_steps_are_kept_too(tmp_path, monkeypatch):
    """A TP group of two replicas keeps its steps in its members' step cache: a second
    group over them loads every step untraced and gives the same tokens."""
    from medha_jax.engine import tp_group

    members = [Engine(m, CFG, step_cache_dir=tmp_path) for m in replica_models("tiny", 2)]
    first = tp_group.TPGroupEngine(members)
    first.warmup(progress=False)
    expected = tokens(first, 2)
    saved = len(list(tmp_path.glob("*.pkl")))
    assert saved == len(first.ladder.all_shapes())

    class Untraceable:
        def lower(self, *args, **kwargs):
            raise AssertionError("a cached step was traced")

    monkeypatch.setattr(tp_group, "tp_step_fn", lambda *args, **kwargs: Untraceable())
    second = tp_group.TPGroupEngine(members)
    second.warmup(progress=False)
    assert tokens(second, 2) == expected
    assert len(list(tmp_path.glob("*.pkl"))) == saved


def run_script(script: str, *args: str) -> str:
    """stdout of `script` run in a fresh Python process (its own JAX caches) with `args`."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


_RUN_ONE_STEP = """
import sys, jax
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
if sys.argv[1]:
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
from medha_jax.engine import EngineConfig
from medha_jax.engine.cache_dirs import CACHE_EVENTS
from tests.test_step_cache import CFG, Engine, replica_models, tokens
CACHE_EVENTS.register()
engine = Engine(replica_models("tiny", 1)[0], CFG, step_cache_dir=sys.argv[2] or None)
print("tokens", tokens(engine, 3), engine.steps_loaded)
"""


@pytest.mark.slow
def test_a_step_jax_loaded_from_its_own_cache_is_not_kept(tmp_path):
    """On the CPU backend an executable JAX loaded from its persistent cache serializes
    without its compiled functions (running the copy in another process fails with
    NOT_FOUND). Process 1 fills JAX's cache, process 2 compiles through it (a JAX hit: not
    kept), process 3 must then compile, not load a broken copy, and give the same tokens."""
    def run(jax_dir, steps_dir):
        return run_script(_RUN_ONE_STEP, jax_dir, steps_dir).split("tokens ", 1)[1].strip()

    jax_dir, steps_dir = str(tmp_path / "xla"), str(tmp_path / "steps")
    first = run(jax_dir, "")
    assert run(jax_dir, steps_dir) == first
    assert not list((tmp_path / "steps").glob("*.pkl"))
    assert run("", steps_dir) == first


_COMPILE_ONE_PROGRAM = """
import sys, jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
if sys.argv[1]:
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
from medha_jax.engine import step_cache

@jax.jit
def program(x, y):
    return jnp.where(x > 0, x * y + 1.0, jnp.tanh(y) - x).sum(-1)

x = jnp.arange(64.0).reshape(8, 8) - 20
for directory in sys.argv[2:]:
    executable, _ = step_cache.load_or_compile(
        "program", lambda: program.lower(x, x).compile(), jax.devices()[:1], directory)
    print("result", np.asarray(executable(x, x)).tolist())
"""


def test_only_what_xla_compiled_in_the_call_is_kept(tmp_path):
    """JAX's in-memory cache serves a second compile of a program with no cache event, and
    what it serves may be the executable JAX had loaded from its persistent cache: process
    2 compiles through JAX's cache (a hit, not kept), then again into another directory
    (from memory: not kept either). Before this was checked that copy was kept, and
    process 3 failed running it with NOT_FOUND (so did every step of a Server started a
    third time in one process, from the copies of its second start)."""
    def run(jax_dir, *step_dirs):
        return run_script(_COMPILE_ONE_PROGRAM, jax_dir, *step_dirs).split("result ")[1:]

    jax_dir, steps = str(tmp_path / "xla"), [str(tmp_path / f"steps{i}") for i in range(3)]
    (want,) = run(jax_dir, steps[0])            # a real compile: kept
    assert (tmp_path / "steps0" / "program.pkl").is_file()
    assert run(jax_dir, steps[1], steps[2]) == [want, want]
    assert not (tmp_path / "steps1").exists() and not (tmp_path / "steps2").exists()
    assert run("", steps[2], steps[0]) == [want, want]     # compiled; loaded
