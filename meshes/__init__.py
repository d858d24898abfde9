"""Device meshes, logical-axis rules and multi-host start-up. Imports nothing from medha_jax.

`ParallelConfig` and `MESH_AXES` are plain Python; the rest imports JAX on first use, so
`import medha_jax` (which re-exports ParallelConfig) stays cheap.
"""

import importlib

from meshes.parallel import MESH_AXES, ParallelConfig

_LAZY = {
    "cluster_detected": "meshes.distributed",
    "initialize_distributed": "meshes.distributed",
    "make_mesh": "meshes.mesh",
    "parallel_config_of": "meshes.mesh",
    "DEFAULT_RULES": "meshes.rules",
    "LOGICAL_AXES": "meshes.rules",
    "LogicalRules": "meshes.rules",
    "put": "meshes.rules",
    "put_replicated": "meshes.rules",
    "replicated": "meshes.rules",
}

__all__ = ["MESH_AXES", "ParallelConfig", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'meshes' has no attribute {name!r}")
