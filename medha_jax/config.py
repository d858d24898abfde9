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
class LinearScaling:
    """Linear RoPE scaling (Gemma-3's global layers on 4B and up): positions divided by
    `factor`, i.e. every inverse frequency is."""

    factor: float

    def __post_init__(self):
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")


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
    # Gemma-3: RMSNorm scales by (1 + w) in float32 (its norms are stored centred on 0), the
    # embedding is multiplied by sqrt(hidden_size), attention and MLP outputs are normed
    # again before their residual add, and the MLP gate is GELU (tanh form), not SiLU.
    norm_offset: float = 0.0
    scale_embedding: bool = False
    post_norms: bool = False
    mlp_activation: str = "silu"   # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaForCausalLM", "llama"),
    "mistral": Family("mistral", "MistralForCausalLM", "llama"),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", "qwen2", qkv_bias=True,
                    gguf_interleaved_qk=False),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", "qwen3", qk_norm=True,
                    gguf_interleaved_qk=False),
    "gemma3": Family("gemma3", "Gemma3ForCausalLM", "gemma3", qk_norm=True,
                     gguf_interleaved_qk=False, norm_offset=1.0, scale_embedding=True,
                     post_norms=True, mlp_activation="gelu_tanh"),
}

# Layer kinds of `ModelConfig.layer_types` (transformers' names).
SLIDING_LAYER, FULL_LAYER = "sliding_attention", "full_attention"


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
    rope_scaling: RopeScaling | YarnScaling | LinearScaling | None = None
    max_position_embeddings: int = 8192
    # Keys older than this many positions are masked (Mistral): query at p sees keys
    # p - sliding_window + 1 .. p. None: full causal attention.
    sliding_window: int | None = None
    # Per layer, SLIDING_LAYER or FULL_LAYER (Gemma-3's interleaved local and global layers):
    # sliding_window then applies to the sliding layers only. None: every layer alike.
    layer_types: tuple[str, ...] | None = None
    # RoPE base of the sliding layers, unscaled (Gemma-3's rope_local_base_freq); the full
    # layers use rope_theta and rope_scaling. None: the same RoPE in every layer.
    local_rope_theta: float | None = None
    # Attention scores are scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5).
    query_pre_attn_scalar: float | None = None
    # logits -> c * tanh(logits / c) (Gemma's final_logit_softcapping). None: none.
    final_logit_softcapping: float | None = None
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
        if self.layer_types is not None:
            if (len(self.layer_types) != self.num_layers
                    or set(self.layer_types) - {SLIDING_LAYER, FULL_LAYER}):
                raise ValueError(
                    f"ModelConfig.layer_types must list {SLIDING_LAYER!r} or {FULL_LAYER!r} for "
                    f"each of the {self.num_layers} layers, got {self.layer_types!r}")
            if SLIDING_LAYER in self.layer_types and self.sliding_window is None:
                raise ValueError(f"ModelConfig.layer_types has {SLIDING_LAYER!r} layers but "
                                 "sliding_window is None")
        for field in ("local_rope_theta", "query_pre_attn_scalar", "final_logit_softcapping"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{field} must be > 0 or None, got {value!r}")
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

    @property
    def mixed_layers(self) -> bool:
        """Sliding and full layers interleaved (Gemma-3): the window and the RoPE are chosen
        per layer inside the layer scan."""
        return self.layer_types is not None and len(set(self.layer_types)) > 1

    @property
    def uniform_window(self) -> int | None:
        """The window of every layer when all layers are alike (not `mixed_layers`)."""
        return self.sliding_window if all(self.sliding_layers()) else None

    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: whether sliding_window applies to it."""
        if self.layer_types is None:
            return (self.sliding_window is not None,) * self.num_layers
        return tuple(kind == SLIDING_LAYER for kind in self.layer_types)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def num_params(self) -> int:
        """Parameter count (embeddings included, counted once when tied)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * d * f + (4 if self.family_spec.post_norms else 2) * d
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
    # Gemma-3-1B: five sliding layers (window 512, RoPE base 1e4) to one global (1e6).
    "gemma3-1b": ModelConfig(
        name="gemma3-1b", family="gemma3", vocab_size=262_144, hidden_size=1152,
        num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256, intermediate_size=6912,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, local_rope_theta=10_000.0,
        max_position_embeddings=32_768, sliding_window=512,
        layer_types=tuple(FULL_LAYER if (i + 1) % 6 == 0 else SLIDING_LAYER for i in range(26)),
        query_pre_attn_scalar=256, tie_word_embeddings=True, dtype="bfloat16"),
    # Tiny shapes for tests: GQA ratio 4 with llama3 rope scaling, and tied embeddings.
    "tiny": ModelConfig(
        name="tiny", vocab_size=256, hidden_size=64, num_layers=2, num_heads=8,
        num_kv_heads=2, head_dim=16, intermediate_size=128,
        rope_theta=10_000.0, max_position_embeddings=2048,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64)),
    # Gemma-3's layer kinds in miniature (the window and the RoPE chosen per layer).
    "tiny-gemma3": ModelConfig(
        name="tiny-gemma3", family="gemma3", vocab_size=256, hidden_size=64, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
        rope_theta=1_000_000.0, local_rope_theta=10_000.0, max_position_embeddings=2048,
        sliding_window=24, layer_types=(SLIDING_LAYER, FULL_LAYER),
        query_pre_attn_scalar=16, tie_word_embeddings=True),
    # Mistral's sliding window in miniature: every layer sees only the last 20 positions.
    "tiny-mistral": ModelConfig(
        name="tiny-mistral", family="mistral", vocab_size=256, hidden_size=64, num_layers=2,
        num_heads=8, num_kv_heads=2, head_dim=16, intermediate_size=128,
        rope_theta=10_000.0, max_position_embeddings=2048, sliding_window=20),
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

__all__ = ["FAMILIES", "FULL_LAYER", "MESH_AXES", "MODEL_PRESETS", "SLIDING_LAYER", "Family",
           "LinearScaling", "ModelConfig", "ParallelConfig", "RopeScaling", "YarnScaling",
           "model_preset"]
