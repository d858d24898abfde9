"""Logical axis names -> mesh axes: the one table that decides how everything is sharded.

Parameters and caches name their dimensions logically ("heads", "pages", ...); nothing
outside this package and the shard_map wrappers names a mesh axis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshes.parallel import MESH_AXES

LOGICAL_AXES = ("embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers", "pages",
                "page_slot", "tokens", "seqs")


@dataclasses.dataclass(frozen=True)
class LogicalRules:
    """Maps each logical axis to a mesh axis (or None = replicated).

    A dimension that does not divide its mesh axis is an error that names both. (Shapes that
    real checkpoints do not divide are changed before they get here: the model pads its
    vocabulary and repeats K/V heads, see medha_jax.model.params.MeshLayout.)
    """

    rules: tuple[tuple[str, str | None], ...]

    def __post_init__(self):
        seen = set()
        for logical, mesh_axis in self.rules:
            if logical not in LOGICAL_AXES:
                raise ValueError(f"unknown logical axis {logical!r}; known: {LOGICAL_AXES}")
            if logical in seen:
                raise ValueError(f"logical axis {logical!r} appears twice in the rules")
            if mesh_axis is not None and mesh_axis not in MESH_AXES:
                raise ValueError(f"rule {logical!r} -> {mesh_axis!r}: mesh axis must be one of {MESH_AXES}")
            seen.add(logical)

    def mesh_axis(self, logical: str | None) -> str | None:
        if logical is None:
            return None
        for name, mesh_axis in self.rules:
            if name == logical:
                return mesh_axis
        raise ValueError(f"no rule for logical axis {logical!r}")

    def spec(self, logical_axes: Sequence[str | None]) -> PartitionSpec:
        """PartitionSpec for a tensor whose dimensions have these logical names.

        Raises when two dimensions would be sharded over the same mesh axis (a collision).
        """
        mesh_axes = [self.mesh_axis(name) for name in logical_axes]
        used = [axis for axis in mesh_axes if axis is not None]
        if len(used) != len(set(used)):
            raise ValueError(
                f"logical axes {tuple(logical_axes)} map to {tuple(mesh_axes)}: "
                "a mesh axis may shard at most one dimension of a tensor")
        return PartitionSpec(*mesh_axes)

    def sharding(self, mesh: Mesh, shape: Sequence[int],
                 logical_axes: Sequence[str | None]) -> NamedSharding:
        """NamedSharding for `shape`, checking that every sharded dimension divides."""
        if len(shape) != len(logical_axes):
            raise ValueError(f"shape {tuple(shape)} has {len(shape)} dims but logical axes "
                             f"{tuple(logical_axes)} name {len(logical_axes)}")
        spec = self.spec(logical_axes)
        for size, logical, mesh_axis in zip(shape, logical_axes, spec):
            if mesh_axis is not None and size % mesh.shape[mesh_axis]:
                raise ValueError(f"dimension {logical}={size} is not divisible by "
                                 f"{mesh_axis}={mesh.shape[mesh_axis]}")
        return NamedSharding(mesh, spec)


DEFAULT_RULES = LogicalRules(rules=(
    ("embed", None),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("head_dim", None),
    ("mlp", "tp"),
    ("vocab", "tp"),
    ("layers", "spp"),
    ("pages", "kvp"),
    ("page_slot", None),
    ("tokens", None),
    ("seqs", None),
))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def put(x, mesh: Mesh, logical_axes: Sequence[str | None], rules: LogicalRules = DEFAULT_RULES):
    """Places a host array on the mesh according to its logical axes."""
    return jax.device_put(x, rules.sharding(mesh, x.shape, logical_axes))
