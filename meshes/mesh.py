"""The device mesh of one replica: axes (dp, spp, kvp, cp, tp), tp innermost."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from meshes.parallel import MESH_AXES, ParallelConfig


def make_mesh(parallel: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the replica mesh from a ParallelConfig.

    With `devices` given, the axes must multiply to exactly their number. Without, the
    first `parallel.num_devices` local devices are used, so a tp=2 model can run on a
    machine with 8 devices.

    Axis types are Auto and passed explicitly (the default changed between JAX
    releases): parameters and caches carry NamedShardings and GSPMD propagates them
    through the model, which keeps mesh axis names out of model code. Kernels that need
    per-device views enter through shard_map wrappers.
    """
    if devices is None:
        available = jax.devices()
        if parallel.num_devices > len(available):
            raise ValueError(
                f"ParallelConfig({parallel}) needs {parallel.num_devices} devices but only "
                f"{len(available)} {available[0].platform} device(s) are available")
        devices = available[:parallel.num_devices]
    elif len(devices) != parallel.num_devices:
        raise ValueError(
            f"ParallelConfig({parallel}) axes multiply to {parallel.num_devices} but "
            f"{len(devices)} devices were given")
    return jax.make_mesh(parallel.axis_sizes, MESH_AXES,
                         axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=list(devices))


def parallel_config_of(mesh: Mesh) -> ParallelConfig:
    """The ParallelConfig a mesh was built from."""
    return ParallelConfig(**{axis: mesh.shape[axis] for axis in MESH_AXES})
