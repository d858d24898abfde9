"""What makes a server's second start fast: JAX's persistent compilation cache and the fitted
runtime predictor, kept on disk between runs.

    root = cache_root()                     # $MEDHA_CACHE_DIR, else ~/.cache/medha-jax
    enable_compilation_cache(root)          # before the engine compiles
    predictor, how = load_or_fit_predictor(engine, root)

Both live under one directory: `xla/` (JAX's executables, keyed by JAX itself on the HLO, the
compile options, the devices and the jax/jaxlib versions), `steps/` (the engine's steps
keyed without tracing them, `medha_jax.engine.step_cache`) and `predictors/` (one JSON per
(model config, dtype, mesh, engine config, device kind, code that shapes a step's time);
the key is written beside the coefficients). MEDHA_CACHE_DIR=off (or cache_dir=False) turns
both off. The cache is trusted, as JAX's is: whoever can write to it can run code here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import platform
import threading
import time

ENV_VAR = "MEDHA_CACHE_DIR"
OFF = ("", "0", "off", "false", "none")
# Sources whose changes change a step's time or the predictor's meaning: a predictor fitted
# by other code is refitted rather than trusted.
_TIMING_SOURCES = ("engine/engine.py", "engine/step_inputs.py", "engine/calibration.py",
                   "scheduler/predictor.py", "model/llama.py", "model/attention.py")


def cache_root(cache_dir: str | os.PathLike | bool | None = None) -> pathlib.Path | None:
    """The cache directory, or None when caching is off.

    cache_dir: a path; False to turn caching off; None (default) for $MEDHA_CACHE_DIR
    ("off" turns it off), else $XDG_CACHE_HOME/medha-jax, else ~/.cache/medha-jax."""
    if cache_dir is False:
        return None
    if cache_dir is True or cache_dir is None:
        env = os.environ.get(ENV_VAR)
        if env is not None:
            return None if env.strip().lower() in OFF else pathlib.Path(env).expanduser()
        base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
        return pathlib.Path(base) / "medha-jax"
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"cache_dir must be a path, False or None, got {cache_dir!r}")
    return pathlib.Path(cache_dir).expanduser()


# --- JAX's persistent compilation cache ------------------------------------------------------

class _CacheEvents:
    """Counts JAX's compilation-cache events (a process-wide listener, registered once):
    process-wide for the start-up report, and per thread for `compiled_here`."""

    _HIT = "/jax/compilation_cache/cache_hits"
    _MISS = "/jax/compilation_cache/cache_misses"
    _SECONDS_SAVED = "/jax/compilation_cache/compile_time_saved_sec"
    # Around XLA's compile or JAX's persistent-cache read: not fired when JAX serves the
    # executable from its in-memory cache (jax._src.dispatch.BACKEND_COMPILE_EVENT).
    _BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self.seconds_saved = 0.0
        self._registered = False
        self._thread = threading.local()        # this thread's (hits, backend compiles)

    def register(self) -> None:
        import jax

        with self._lock:
            if self._registered:
                return
            self._registered = True
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def _on_event(self, event: str, **kwargs) -> None:
        if event == self._HIT:
            self._thread.hits = getattr(self._thread, "hits", 0) + 1
            with self._lock:
                self.hits += 1
        elif event == self._MISS:
            with self._lock:
                self.misses += 1

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event == self._BACKEND_COMPILE:
            self._thread.compiles = getattr(self._thread, "compiles", 0) + 1
        elif event == self._SECONDS_SAVED:
            with self._lock:
                self.seconds_saved += duration

    def snapshot(self) -> tuple[int, int, float]:
        with self._lock:
            return self.hits, self.misses, self.seconds_saved

    def thread_snapshot(self) -> tuple[int, int]:
        """(persistent-cache hits, backend compiles) seen so far on this thread: JAX fires
        both on the thread that compiles."""
        return getattr(self._thread, "hits", 0), getattr(self._thread, "compiles", 0)

    def compiled_here(self, before: tuple[int, int]) -> bool:
        """Whether, since `before` (a thread_snapshot), this thread's compiles were all real
        XLA compiles: at least one backend compile and no persistent-cache hit. False also
        for an executable JAX served from its in-memory cache, which may be one it had
        loaded from its persistent cache earlier in this process."""
        hits, compiles = self.thread_snapshot()
        return compiles > before[1] and hits == before[0]


CACHE_EVENTS = _CacheEvents()


def enable_compilation_cache(root: pathlib.Path | None) -> pathlib.Path | None:
    """Points JAX's persistent compilation cache at root/xla; returns the directory in use.

    A directory the user already gave JAX (jax_compilation_cache_dir, or its environment
    variable) wins: theirs is returned. root None leaves JAX's settings alone. Which
    executables are written is JAX's choice (those that took longer than
    jax_persistent_cache_min_compile_time_secs to compile, 1 s by default)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    CACHE_EVENTS.register()
    current = jax.config.jax_compilation_cache_dir
    if current:
        return pathlib.Path(current)
    if root is None:
        return None
    directory = root / "xla"
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # JAX decides once per process, at its first compile, whether it has a cache; anything
    # compiled before now (loading, a test before this one) decided "no directory".
    compilation_cache.reset_cache()
    return directory


def steps_dir(root: pathlib.Path | None) -> pathlib.Path | None:
    """Where a Server's engines keep their compiled steps (None when caching is off)."""
    return None if root is None else root / "steps"


# --- Fitted predictors -----------------------------------------------------------------------

def predictor_key(engine) -> dict:
    """What a fitted predictor depends on: the step's shapes and the machine that ran them."""
    import jax

    model = engine.model
    devices = model.mesh.devices.flat
    first = next(iter(devices))
    here = pathlib.Path(__file__).resolve().parent.parent
    code = hashlib.sha256()
    for name in _TIMING_SOURCES:
        path = here / name
        code.update(path.read_bytes() if path.is_file() else name.encode())
    return {
        "model": dataclasses.asdict(model.config),
        "dtype": model.config.dtype,
        "mesh": {str(axis): int(size) for axis, size in model.mesh.shape.items()},
        "engine": dataclasses.asdict(engine.config),
        "device_kind": f"{first.platform}:{first.device_kind}",
        "num_devices": int(model.mesh.devices.size),
        # A CPU "device" is whatever machine this is: its cores decide the step times.
        "host": f"{platform.machine()}:{platform.processor()}:{os.cpu_count()}"
                if first.platform == "cpu" else None,
        "jax": jax.__version__,
        "code": code.hexdigest()[:16],
        # On a CPU: whether the small steps run the native kernels (and which build).
        "kernels": _cpu_kernels() if first.platform == "cpu" else None,
    }


def _cpu_kernels() -> str:
    from pallas_kernels import cpu_native

    return cpu_native.status()


def predictor_path(root: pathlib.Path, engine) -> pathlib.Path:
    key = predictor_key(engine)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in key["model"]["name"])
    return root / "predictors" / f"{name}-{digest}.json"


def load_predictor(engine, root: pathlib.Path | None):
    """(predictor or None, how): the predictor saved for this engine's key under root."""
    from medha_jax.scheduler.predictor import ProfiledPredictor

    if root is None:
        return None, "predictor cache off"
    path = predictor_path(root, engine)
    if not path.is_file():
        return None, f"none saved at {path}"
    try:
        saved = json.loads(path.read_text())
        return (ProfiledPredictor.from_json(json.dumps(saved["predictor"])),
                f"loaded from {path}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{path} was unreadable ({type(e).__name__}: {e})"


def save_predictor(engine, root: pathlib.Path, predictor, **details) -> pathlib.Path:
    """Writes the predictor under its engine key (with `details`, e.g. how it was fitted)."""
    path = predictor_path(root, engine)
    record = {"key": predictor_key(engine), **details,
              "predictor": json.loads(predictor.to_json())}
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written whole, then renamed: a concurrent start reads the old file or the new one.
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, path)
    return path


def load_or_fit_predictor(engine, root: pathlib.Path | None):
    """(predictor, how): the predictor saved for this engine's key under root, else one
    fitted now by a calibration sweep (and saved). how says which, for the start-up log."""
    from medha_jax.engine.calibration import fit_predictor

    if root is None:
        return fit_predictor(engine), "fitted (predictor cache off)"
    predictor, how = load_predictor(engine, root)
    if predictor is not None:
        return predictor, how
    path = predictor_path(root, engine)
    how = (f"refitted into {path}, which was unreadable{how.split('unreadable', 1)[1]}"
           if "unreadable" in how else f"fitted and saved to {path}")
    start = time.perf_counter()
    predictor = fit_predictor(engine)
    seconds = time.perf_counter() - start
    save_predictor(engine, root, predictor, fit_seconds=seconds)
    return predictor, f"{how} (calibration took {seconds:.1f} s)"
