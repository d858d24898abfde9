"""Accelerator peaks: what the analytical predictor and the MFU/MBU figures divide by.

One `HardwareSpec` per device kind, in SI units (FLOP/s, bytes/s, bytes). Peaks are the
vendors' dense bf16 numbers (no structured sparsity); the efficiency a real kernel
reaches lives in the predictor, not here.
"""

from __future__ import annotations

import dataclasses

_GB = 10**9
_GIB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareSpec:
    """Peak capabilities of one device.

    peak_flops:             dense bf16 FLOP/s of one device.
    hbm_bandwidth:          bytes/s between the device and its own memory.
    interconnect_bandwidth: bytes/s one device can send to its peers in one direction
                            (NVLink / ICI), what collectives inside a replica run on.
    memory_bytes:           device memory capacity.
    """

    name: str
    peak_flops: float
    hbm_bandwidth: float
    interconnect_bandwidth: float
    memory_bytes: int

    def __post_init__(self):
        for field in ("peak_flops", "hbm_bandwidth", "interconnect_bandwidth", "memory_bytes"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(
                    f"HardwareSpec.{field} must be > 0, got {value!r} for {self.name!r}")


HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    # NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s bf16 dense, 2,039 GB/s HBM2e,
    # NVLink 3 600 GB/s total = 300 GB/s per direction.
    "a100": HardwareSpec(name="a100", peak_flops=312e12, hbm_bandwidth=2039 * _GB,
                         interconnect_bandwidth=300 * _GB, memory_bytes=80 * _GIB),
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s bf16 dense (1,979 with sparsity), 3.35 TB/s
    # HBM3, NVLink 4 900 GB/s total = 450 GB/s per direction, 80 GB.
    "h100": HardwareSpec(name="h100", peak_flops=989e12, hbm_bandwidth=3350 * _GB,
                         interconnect_bandwidth=450 * _GB, memory_bytes=80 * _GIB),
    # NVIDIA H200 SXM datasheet: same compute as H100, 4.8 TB/s HBM3e, 141 GB
    # (nvidia-smi reports 143,771 MiB; 140 GiB keeps a little aside).
    "h200": HardwareSpec(name="h200", peak_flops=989e12, hbm_bandwidth=4800 * _GB,
                         interconnect_bandwidth=450 * _GB, memory_bytes=140 * _GIB),
    # Google Cloud TPU v5e system architecture page: 197 TFLOP/s bf16, 16 GB HBM2 at
    # 819 GB/s, ICI 1,600 Gbit/s = 200 GB/s per chip.
    "tpu-v5e": HardwareSpec(name="tpu-v5e", peak_flops=197e12, hbm_bandwidth=819 * _GB,
                            interconnect_bandwidth=200 * _GB, memory_bytes=16 * _GB),
    # Google Cloud TPU v5p system architecture page: 459 TFLOP/s bf16, 95 GB HBM2e at
    # 2,765 GB/s, ICI 4,800 Gbit/s = 600 GB/s per chip.
    "tpu-v5p": HardwareSpec(name="tpu-v5p", peak_flops=459e12, hbm_bandwidth=2765 * _GB,
                            interconnect_bandwidth=600 * _GB, memory_bytes=95 * _GB),
}


# A CPU has no preset of its own: an engine on (virtual) CPU devices stands in for a
# deployment on accelerators (tests, notebooks, the simulator's validation), so the choices
# it makes from the hardware (the cp ring's pass-KV / pass-Q thresholds) are the H100's.
CPU_STAND_IN = "h100"


def hardware_for_device_kind(kind: str) -> HardwareSpec:
    """The preset of a device kind key (`pallas_kernels.block_sizes.device_kind_of`: "h100",
    "tpu-v5e", ..., or "cpu", which gets CPU_STAND_IN's)."""
    return hardware_preset(CPU_STAND_IN if kind == "cpu" else kind)


def hardware_preset(name: str) -> HardwareSpec:
    try:
        return HARDWARE_PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown hardware preset {name!r}; known: {', '.join(sorted(HARDWARE_PRESETS))}"
        ) from None
