"""The mesh axes of one replica and their degrees: plain Python, no JAX."""

from __future__ import annotations

import dataclasses
import math

# Outermost first; tp innermost (fastest links). DESIGN.md, "Mesh axes".
MESH_AXES = ("dp", "spp", "kvp", "cp", "tp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Degrees of the five mesh axes, outermost first (see DESIGN.md, 'Mesh axes')."""

    dp: int = 1
    spp: int = 1
    kvp: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self):
        for axis in MESH_AXES:
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelConfig.{axis} must be an int >= 1, got {value!r}")

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in MESH_AXES)

    @property
    def num_devices(self) -> int:
        return math.prod(self.axis_sizes)

    @classmethod
    def parse(cls, text: str) -> "ParallelConfig":
        """Parses 'tp=8,spp=2' (the command-line form)."""
        if not text.strip():
            return cls()
        sizes = {}
        for part in text.split(","):
            axis, sep, value = part.partition("=")
            axis = axis.strip()
            if not sep or axis not in MESH_AXES:
                raise ValueError(
                    f"bad parallel spec {part!r} in {text!r}: expected AXIS=N with AXIS in {MESH_AXES}")
            try:
                sizes[axis] = int(value)
            except ValueError:
                raise ValueError(f"bad parallel degree {value!r} for axis {axis!r}") from None
        return cls(**sizes)

    def __str__(self) -> str:
        return ",".join(f"{axis}={size}" for axis, size in zip(MESH_AXES, self.axis_sizes))
