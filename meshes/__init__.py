"""Device meshes, logical-axis rules and multi-host start-up."""

from meshes.distributed import initialize_distributed
from meshes.mesh import make_mesh, parallel_config_of
from meshes.rules import DEFAULT_RULES, LOGICAL_AXES, LogicalRules, put, replicated

__all__ = ["DEFAULT_RULES", "LOGICAL_AXES", "LogicalRules", "initialize_distributed",
           "make_mesh", "parallel_config_of", "put", "replicated"]
