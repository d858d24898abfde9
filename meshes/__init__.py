"""Device meshes, logical-axis rules and multi-host start-up. Imports nothing from medha_jax."""

from meshes.distributed import initialize_distributed
from meshes.mesh import make_mesh, parallel_config_of
from meshes.parallel import MESH_AXES, ParallelConfig
from meshes.rules import DEFAULT_RULES, LOGICAL_AXES, LogicalRules, put, replicated

__all__ = ["DEFAULT_RULES", "LOGICAL_AXES", "MESH_AXES", "LogicalRules", "ParallelConfig",
           "initialize_distributed", "make_mesh", "parallel_config_of", "put", "replicated"]
