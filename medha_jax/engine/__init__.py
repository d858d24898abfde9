"""The JAX engine: bucketed step inputs built on the host, the jitted step, the sampler."""

from medha_jax.buckets import BucketLadder
from medha_jax.engine.engine import Engine, EngineConfig

__all__ = ["BucketLadder", "Engine", "EngineConfig"]
