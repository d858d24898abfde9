"""A runtime predictor without a calibration sweep: derived at start-up, refined from traffic.

    prior = prior_records(engine, starting_predictor(engine).predict_features)
    refit = OnlineRefit(predictor, prior)
    refit.observe(features, seconds)      # after every served step; True when it refitted

`calibration.fit_predictor` times some 150 synthetic steps before the first request (two
minutes for SmolLM2 on a 2-core CPU, and every step shape compiled first). Instead the
server starts from the analytical roofline (`AnalyticalPredictor`) at the peaks of the
device it runs on: a preset on GPUs and TPUs; on a CPU, which has no preset, a matmul of the
model's width and a copy, timed here in well under a second. It is expressed as the
profiled model (`ProfiledPredictor`) fitted to the roofline's times over the calibration
sweep's shapes (`prior_records`), so the scheduler runs on one predictor class either way.
Served steps then refine it: `OnlineRefit` refits the profiled model to the prior records
and the measured ones together, so measured shapes take over while shapes the traffic has
not run yet keep the prior's price. The prior is rough (a roofline misses the CPU's fixed
costs per layer); the first refit comes after a few steps.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from medha_jax.engine.calibration import sweep_chunks
from medha_jax.scheduler.hardware import HardwareSpec, hardware_for_device_kind
from medha_jax.scheduler.predictor import (AnalyticalPredictor, BatchFeatures, Efficiency,
                                           ProfiledPredictor)

if TYPE_CHECKING:
    from medha_jax.engine.engine import Engine

Record = tuple[BatchFeatures, float]
# Measured steps after which the predictor is refitted, then every REFIT_EVERY more.
REFIT_AT = (16, 64, 256)
REFIT_EVERY = 1024
# Measured steps a refit weighs (the newest): enough to cover every shape served lately.
MEASURED_KEPT = 2048
# The prior's weight in a refit, in measured steps: spread over its records, so it decides
# the shapes no step has measured and gives way wherever steps were measured. Small: the fit
# minimises relative error, where a prior k times too fast weighs like k^2 measured steps
# (with 2, a prior 3x off still pulls the fit 25% its way after 64 steps, 4% after 256).
PRIOR_WEIGHT = 2.0
# On a CPU the roofline's inputs are measured; the kernels' fractions of them are then 1,
# except attention (the XLA path gathers pages) and a fixed cost per step (30 layers of
# small ops for SmolLM2).
CPU_EFFICIENCY = Efficiency(matmul=1.0, attention=0.5, hbm=1.0, interconnect=1.0,
                            step_overhead_s=5e-3)


def measure_cpu_peaks(model_config, *, repeats: int = 5) -> HardwareSpec:
    """A HardwareSpec of this CPU as one step sees it: FLOP/s of a float32 matmul of the
    model's MLP shape ([256, hidden] x [hidden, intermediate]) and bytes/s of a 32 MiB
    copy, each the best of `repeats` timed runs after a first one (compile, first touch)."""
    import jax
    import jax.numpy as jnp

    d, f = model_config.hidden_size, model_config.intermediate_size
    key = jax.random.key(0)
    a = jax.random.normal(key, (256, d), jnp.float32)
    b = jax.random.normal(key, (d, f), jnp.float32)
    x = jnp.zeros(8 * 2**20, jnp.float32)
    matmul, copy = jax.jit(jnp.matmul), jax.jit(lambda v: v + 1.0)

    def best(fn, *args) -> float:
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - start)
        return min(times)

    flops = 2 * 256 * d * f / best(matmul, a, b)
    bandwidth = 2 * x.nbytes / best(copy, x)
    return HardwareSpec(name="cpu-measured", peak_flops=flops, hbm_bandwidth=bandwidth,
                        interconnect_bandwidth=bandwidth, memory_bytes=2**34)


def starting_predictor(engine: Engine) -> tuple[AnalyticalPredictor, str]:
    """The engine's analytical roofline and how its peaks were found (for the start-up log)."""
    from pallas_kernels.block_sizes import device_kind_of

    kind = device_kind_of(engine.model.mesh.devices.flat[0])
    if kind == "cpu":
        hardware, efficiency = measure_cpu_peaks(engine.model.config), CPU_EFFICIENCY
        how = (f"CPU peaks measured now: {hardware.peak_flops / 1e9:.0f} GFLOP/s, "
               f"{hardware.hbm_bandwidth / 1e9:.1f} GB/s")
    else:
        hardware, efficiency = hardware_for_device_kind(kind), Efficiency()
        how = f"preset {hardware.name}"
    return AnalyticalPredictor(engine.model.config, engine.model.parallel, hardware,
                               efficiency=efficiency, token_buckets=engine.ladder.token_buckets,
                               kv_tokens_per_shard=engine.allocator.max_tokens_per_shard
                               if engine.num_kv_shards > 1 else None), how


def prior_records(engine: Engine, predict: Callable[[BatchFeatures], float], *,
                  seed: int = 0) -> list[Record]:
    """(features, predict(features)) over the calibration sweep's batches: what the
    predictor believes about every shape the packer chooses between, without running one."""
    buckets = engine.ladder.token_buckets
    records = []
    for chunks in sweep_chunks(engine, np.random.default_rng(seed)):
        features = BatchFeatures()
        for start, num_tokens in chunks:
            features = features.plus_chunk(num_tokens, start, True, buckets)
        records.append((features, predict(features)))
    return records


class OnlineRefit:
    """Refits a ProfiledPredictor in place to its prior records and measured steps.

    In place: the scheduler's packer holds `predictor` and sees the new coefficients at
    its next batch (its precomputed tables are the caller's to refresh: `observe` says
    when). The prior's records weigh PRIOR_WEIGHT measured steps in all, so measured
    steps dominate wherever they cover a shape."""

    def __init__(self, predictor: ProfiledPredictor, prior: Iterable[Record]):
        self.predictor = predictor
        self.prior = [r for r in prior if r[1] > 0 and math.isfinite(r[1])]
        self.measured: collections.deque[Record] = collections.deque(maxlen=MEASURED_KEPT)
        self.num_observed = 0
        self.num_refits = 0

    @classmethod
    def fitted_to_prior(cls, engine: Engine, predict: Callable[[BatchFeatures], float]
                        ) -> OnlineRefit:
        """A ProfiledPredictor fitted to `predict` over the sweep's shapes, to refine."""
        prior = prior_records(engine, predict)
        return cls(ProfiledPredictor.fit(prior, token_buckets=engine.ladder.token_buckets),
                   prior)

    def due(self) -> bool:
        n = self.num_observed
        return n in REFIT_AT or (n > REFIT_AT[-1] and n % REFIT_EVERY == 0)

    def observe(self, features: BatchFeatures, seconds: float) -> bool:
        """Adds a measured step; refits when enough new ones came. True when it refitted."""
        if not (seconds > 0 and math.isfinite(seconds)) or features.seqs == 0:
            return False
        self.measured.append((features, seconds))
        self.num_observed += 1
        if not self.due():
            return False
        prior_weight = PRIOR_WEIGHT / max(len(self.prior), 1)
        fitted = ProfiledPredictor.fit(
            [*self.prior, *self.measured], token_buckets=self.predictor.token_buckets,
            weights=[prior_weight] * len(self.prior) + [1.0] * len(self.measured))
        p = self.predictor
        p.coefficients = fitted.coefficients
        p.median_rel_error, p.p90_rel_error = fitted.median_rel_error, fitted.p90_rel_error
        p.num_records = fitted.num_records
        self.num_refits += 1
        return True
