"""Fast restarts: the cache directory's rules, the fitted predictor saved per key and reused,
and a second Server start (its own process, as a restart is) that loads its executables
from JAX's persistent compilation cache and its predictor from disk and gives the same
tokens. Times are the benchmark's business (benchmarks/restart.py), not asserted here."""

import json
import os
import subprocess
import sys

import pytest

from medha_jax import load_model
from medha_jax.engine import Engine, EngineConfig
from medha_jax.engine import cache_dirs
from tests.test_server import TINY_ENGINE


def test_cache_root_rules(monkeypatch, tmp_path):
    monkeypatch.delenv(cache_dirs.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dirs.cache_root() == tmp_path / "xdg" / "medha-jax"
    monkeypatch.setenv(cache_dirs.ENV_VAR, str(tmp_path / "env"))
    assert cache_dirs.cache_root() == tmp_path / "env"
    assert cache_dirs.cache_root(tmp_path / "arg") == tmp_path / "arg"
    assert cache_dirs.cache_root(False) is None
    monkeypatch.setenv(cache_dirs.ENV_VAR, "off")
    assert cache_dirs.cache_root() is None
    with pytest.raises(TypeError, match="cache_dir"):
        cache_dirs.cache_root(3)


@pytest.fixture(scope="module")
def engine():
    return Engine(load_model("tiny"), TINY_ENGINE)


def test_predictor_is_saved_then_loaded_and_keyed_by_the_engine(engine, tmp_path):
    first, how = cache_dirs.load_or_fit_predictor(engine, tmp_path)
    assert how.startswith("fitted and saved to")
    path = cache_dirs.predictor_path(tmp_path, engine)
    saved = json.loads(path.read_text())
    assert saved["key"]["engine"]["max_seqs"] == TINY_ENGINE.max_seqs
    assert saved["key"]["model"]["name"] == "tiny" and saved["key"]["mesh"]
    second, how = cache_dirs.load_or_fit_predictor(engine, tmp_path)
    assert how == f"loaded from {path}"
    assert second.to_json() == first.to_json()
    # Another engine config (another compiled ladder) is another predictor.
    other = Engine(engine.model, EngineConfig(**{**vars(TINY_ENGINE), "max_seqs": 4}))
    assert cache_dirs.predictor_path(tmp_path, other) != path


def test_an_unreadable_predictor_is_refitted(engine, tmp_path):
    path = cache_dirs.predictor_path(tmp_path, engine)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    predictor, how = cache_dirs.load_or_fit_predictor(engine, tmp_path)
    assert how.startswith("refitted into") and "unreadable" in how
    assert cache_dirs.load_or_fit_predictor(engine, tmp_path)[1] == f"loaded from {path}"


def test_no_cache_fits_and_writes_nothing(engine, tmp_path):
    _, how = cache_dirs.load_or_fit_predictor(engine, None)
    assert how == "fitted (predictor cache off)"


CHILD = """
import dataclasses, json, sys
from medha_jax import SamplingParams
from serving.server import Server
from tests.test_server import TINY_ENGINE
with Server("tiny", engine_config=TINY_ENGINE, cache_dir=sys.argv[1]) as server:
    out = server.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=6))[0]
    print(json.dumps({**dataclasses.asdict(server.startup), "tokens": list(out.token_ids)}))
"""


@pytest.mark.slow
def test_second_start_loads_executables_and_predictor(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           # The tiny model compiles in well under JAX's 1 s threshold for caching.
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    env.pop(cache_dirs.ENV_VAR, None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)

    def start():
        proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    first, second = start(), start()
    # (The first start may already hit: the same computation compiled twice in one run.)
    assert first["executables_compiled_and_saved"] >= 1
    # No calibration sweep: the roofline's predictor, saved for the next start.
    assert first["predictor"].startswith("derived from the roofline")
    assert "saved to" in first["predictor"]
    assert second["executables_loaded"] >= first["executables_compiled_and_saved"]
    assert second["executables_compiled_and_saved"] == 0
    assert second["predictor"].startswith("loaded from")
    assert second["tokens"] == first["tokens"]
    assert second["compilation_cache_dir"] == str(tmp_path / "xla")
    assert any((tmp_path / "xla").iterdir())
