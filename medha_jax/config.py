"""Static configuration: the model's shape. The parallel layout lives in `meshes.parallel`.

Frozen dataclasses: hashable, so they can be static arguments of jitted functions, and
validated once at construction.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 ("llama3") frequency-dependent RoPE scaling.

    Wavelengths longer than original_max_position_embeddings / low_freq_factor are
    divided by `factor`, shorter than .../high_freq_factor are kept, and the band in
    between is interpolated smoothly (as in transformers' `_compute_llama3_parameters`).
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                "rope_scaling needs high_freq_factor > low_freq_factor > 0, got "
                f"{self.high_freq_factor=} {self.low_freq_factor=}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of a Llama-3 family decoder."""

    name: str = "custom"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    dtype: str = "float32"

    def __post_init__(self):
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "intermediate_size",
                      "max_position_embeddings"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{field} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"ModelConfig.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        """Parameter count (embeddings included, counted once when tied)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + self.num_layers * per_layer + d + head

    def kv_bytes_per_token(self, bytes_per_value: int | None = None) -> int:
        """Bytes of K and V cache one token occupies over all layers."""
        if bytes_per_value is None:
            bytes_per_value = 4 if self.dtype == "float32" else 2
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value


_LLAMA3_ROPE = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                           original_max_position_embeddings=8192)

MODEL_PRESETS: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(
        name="llama3-8b", vocab_size=128_256, hidden_size=4096, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14_336,
        rope_theta=500_000.0, max_position_embeddings=8192, dtype="bfloat16"),
    "llama3.1-8b": ModelConfig(
        name="llama3.1-8b", vocab_size=128_256, hidden_size=4096, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14_336,
        rope_theta=500_000.0, rope_scaling=_LLAMA3_ROPE,
        max_position_embeddings=131_072, dtype="bfloat16"),
    "llama3-70b": ModelConfig(
        name="llama3-70b", vocab_size=128_256, hidden_size=8192, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, intermediate_size=28_672,
        rope_theta=500_000.0, max_position_embeddings=8192, dtype="bfloat16"),
    "llama3.1-70b": ModelConfig(
        name="llama3.1-70b", vocab_size=128_256, hidden_size=8192, num_layers=80,
        num_heads=64, num_kv_heads=8, head_dim=128, intermediate_size=28_672,
        rope_theta=500_000.0, rope_scaling=_LLAMA3_ROPE,
        max_position_embeddings=131_072, dtype="bfloat16"),
    # SmolLM2-135M: the shape of the embedded default model (weights come from its GGUF).
    "smollm2-135m": ModelConfig(
        name="smollm2-135m", vocab_size=49_152, hidden_size=576, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
        rms_norm_eps=1e-5, rope_theta=100_000.0, max_position_embeddings=8192,
        tie_word_embeddings=True),
    # Tiny shapes for tests: GQA ratio 4 with llama3 rope scaling, and tied embeddings.
    "tiny": ModelConfig(
        name="tiny", vocab_size=256, hidden_size=64, num_layers=2, num_heads=8,
        num_kv_heads=2, head_dim=16, intermediate_size=128,
        rope_theta=10_000.0, max_position_embeddings=2048,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64)),
    "tiny-tied": ModelConfig(
        name="tiny-tied", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4,
        num_kv_heads=4, head_dim=16, intermediate_size=96,
        rope_theta=10_000.0, max_position_embeddings=2048, tie_word_embeddings=True),
}


def model_preset(name: str) -> ModelConfig:
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; known: {', '.join(sorted(MODEL_PRESETS))}") from None


# The parallel layout belongs to `meshes` (DESIGN.md: dependencies point medha_jax -> meshes);
# re-exported here so `from medha_jax.config import ParallelConfig` keeps working.
from meshes.parallel import MESH_AXES, ParallelConfig  # noqa: E402

__all__ = ["MESH_AXES", "MODEL_PRESETS", "ModelConfig", "ParallelConfig", "RopeScaling",
           "model_preset"]
