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


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (Qwen2.5's long-context configs), as transformers'
    `_compute_yarn_parameters`: frequencies whose wavelength fits beta_fast rotations in the
    original context are kept, those with fewer than beta_slow are divided by `factor`, a
    linear ramp between; cos and sin are multiplied by attention_factor."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0   # resolved from factor (0.1 ln(factor) + 1) when absent
    truncate: bool = True

    def __post_init__(self):
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError("rope_scaling.original_max_position_embeddings must be > 0, got "
                             f"{self.original_max_position_embeddings}")


@dataclasses.dataclass(frozen=True)
class Family:
    """A decoder family as its differences from the Llama block (DESIGN: one parameter
    table, `model.params.param_specs`, reads these flags)."""

    name: str
    hf_architecture: str           # config.json `architectures`
    gguf_architecture: str         # GGUF `general.architecture`
    qkv_bias: bool = False         # biases on the q, k and v projections
    qk_norm: bool = False          # RMSNorm over head_dim of each q and k head, before RoPE
    # llama.cpp's converter permutes Q/K rows for its interleaved RoPE only for the
    # architectures it runs with that RoPE ("llama"); Qwen's use rotate_half ("NEOX").
    gguf_interleaved_qk: bool = True


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaForCausalLM", "llama"),
    "mistral": Family("mistral", "MistralForCausalLM", "llama"),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True,
                    gguf_interleaved_qk=False),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", "qwen3", qk_norm=True,
                    gguf_interleaved_qk=False),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of a dense decoder: the Llama block and its family's differences (`FAMILIES`)."""

    name: str = "custom"
    family: str = "llama"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    rope_scaling: RopeScaling | YarnScaling | None = None
    max_position_embeddings: int = 8192
    # Keys older than this many positions are masked (Mistral): query at p sees keys
    # p - sliding_window + 1 .. p. None: full causal attention.
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    dtype: str = "float32"

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"ModelConfig.family={self.family!r} is not one of "
                             f"{sorted(FAMILIES)}")
        if self.sliding_window is not None and (
                not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"ModelConfig.sliding_window must be a positive int or None, got "
                             f"{self.sliding_window!r}")
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
    def family_spec(self) -> Family:
        return FAMILIES[self.family]

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        """Parameter count (embeddings included, counted once when tied)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * d * f + 2 * d
        if self.family_spec.qkv_bias:
            per_layer += self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
        if self.family_spec.qk_norm:
            per_layer += 2 * self.head_dim
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
    # Other families, each at a small real size (config.json shapes of the released models).
    "qwen2.5-0.5b": ModelConfig(
        name="qwen2.5-0.5b", family="qwen2", vocab_size=151_936, hidden_size=896,
        num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, intermediate_size=4864,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=32_768,
        tie_word_embeddings=True, dtype="bfloat16"),
    "qwen3-0.6b": ModelConfig(
        name="qwen3-0.6b", family="qwen3", vocab_size=151_936, hidden_size=1024,
        num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128, intermediate_size=3072,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, max_position_embeddings=40_960,
        tie_word_embeddings=True, dtype="bfloat16"),
    "mistral-7b-v0.1": ModelConfig(
        name="mistral-7b-v0.1", family="mistral", vocab_size=32_000, hidden_size=4096,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14_336,
        rope_theta=10_000.0, max_position_embeddings=32_768, sliding_window=4096,
        dtype="bfloat16"),
    # Mistral-Nemo: head_dim 128 though hidden / heads is 160.
    "mistral-nemo-12b": ModelConfig(
        name="mistral-nemo-12b", family="mistral", vocab_size=131_072, hidden_size=5120,
        num_layers=40, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14_336,
        rope_theta=1_000_000.0, max_position_embeddings=1_024_000, dtype="bfloat16"),
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

__all__ = ["FAMILIES", "MESH_AXES", "MODEL_PRESETS", "Family", "ModelConfig", "ParallelConfig",
           "RopeScaling", "YarnScaling", "model_preset"]
