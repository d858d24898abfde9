"""Logical axis names -> mesh axes: the one table that decides how everything is sharded.

Parameters and caches name their dimensions logically ("heads", "pages", ...); nothing
outside this package and the shard_map wrappers names a mesh axis.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshes.parallel import MESH_AXES

LOGICAL_AXES = ("embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers", "pages",
                "page_slot", "tokens", "seqs")


def _as_tuple(mesh_axis: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if mesh_axis is None:
        return ()
    return (mesh_axis,) if isinstance(mesh_axis, str) else tuple(mesh_axis)


@dataclasses.dataclass(frozen=True)
class LogicalRules:
    """Maps each logical axis to a mesh axis, a tuple of mesh axes (sharded over their
    product, outermost first), or None (replicated).

    A dimension that does not divide its mesh axis is an error that names both. (Shapes that
    real checkpoints do not divide are changed before they get here: the model pads its
    vocabulary and repeats K/V heads, see medha_jax.model.params.MeshLayout.)
    """

    rules: tuple[tuple[str, str | tuple[str, ...] | None], ...]

    def __post_init__(self):
        seen = set()
        for logical, mesh_axis in self.rules:
            if logical not in LOGICAL_AXES:
                raise ValueError(f"unknown logical axis {logical!r}; known: {LOGICAL_AXES}")
            if logical in seen:
                raise ValueError(f"logical axis {logical!r} appears twice in the rules")
            for axis in _as_tuple(mesh_axis):
                if axis not in MESH_AXES:
                    raise ValueError(f"rule {logical!r} -> {mesh_axis!r}: mesh axis must be one "
                                     f"of {MESH_AXES}")
            seen.add(logical)

    def mesh_axis(self, logical: str | None) -> str | tuple[str, ...] | None:
        if logical is None:
            return None
        for name, mesh_axis in self.rules:
            if name == logical:
                return mesh_axis
        raise ValueError(f"no rule for logical axis {logical!r}")

    def degree(self, mesh: Mesh, logical: str) -> int:
        """How many shards the logical axis has on `mesh` (1 when replicated)."""
        return math.prod(mesh.shape[axis] for axis in _as_tuple(self.mesh_axis(logical)))

    def spec(self, logical_axes: Sequence[str | None]) -> PartitionSpec:
        """PartitionSpec for a tensor whose dimensions have these logical names.

        Raises when two dimensions would be sharded over the same mesh axis (a collision).
        """
        mesh_axes = [self.mesh_axis(name) for name in logical_axes]
        used = [axis for mesh_axis in mesh_axes for axis in _as_tuple(mesh_axis)]
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
        for size, logical in zip(shape, logical_axes):
            degree = 1 if logical is None else self.degree(mesh, logical)
            if size % degree:
                raise ValueError(f"dimension {logical}={size} is not divisible by "
                                 f"{self.mesh_axis(logical)}={degree}")
        return NamedSharding(mesh, spec)


DEFAULT_RULES = LogicalRules(rules=(
    ("embed", None),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("head_dim", None),
    ("mlp", "tp"),
    ("vocab", "tp"),
    ("layers", "spp"),
    # The paged cache is split over KV shards (kvp) and context-parallel ranks (cp): each cp
    # rank keeps the K/V of the tokens it computed. The engine runs one of the two at a time.
    ("pages", ("kvp", "cp")),
    ("page_slot", None),
    # A step's tokens are split over cp ranks for the whole layer (seed 002 section 3.5.1).
    ("tokens", "cp"),
    ("seqs", None),
))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def put_replicated(arrays, sharding: NamedSharding):
    """Places host arrays (a pytree) whole on every device of a replicated `sharding`.

    On a mesh spanning several processes, `jax.device_put` of a host array first checks
    that every process passed the same value (`multihost_utils.assert_equal`: a collective
    with no timeout, and a compile per new shape); a multi-host replica's processes hold
    the same step inputs by construction (serving.multihost), so each process places its
    own copy on its own devices instead."""
    if sharding.is_fully_addressable:
        return jax.device_put(arrays, sharding)
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), arrays)


def put(x, mesh: Mesh, logical_axes: Sequence[str | None], rules: LogicalRules = DEFAULT_RULES):
    """Places a host array on the mesh according to its logical axes."""
    return jax.device_put(x, rules.sharding(mesh, x.shape, logical_axes))
