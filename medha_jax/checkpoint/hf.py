"""Hugging Face checkpoint directories: config.json + safetensors (+ tokenizer.json).

A multimodal checkpoint whose text tower is a supported family (Gemma-3 4B/12B/27B,
`Gemma3ForConditionalGeneration`) loads as that text model: its `text_config`, and its
text tower's tensors under their *ForCausalLM names; the vision tower's are not loaded.

    ckpt = load_hf_checkpoint("path/to/Llama-3.1-8B")
    ckpt.tensors["layers.wq"].read((slice(0, 4), slice(None), slice(8, 16), slice(None)))

Safetensors files are memory-mapped and read through `safe_open(...).get_slice`, so a
read touches only the layers and rows it asks for. Weights may be sharded over several
files (model.safetensors.index.json) and stored in float32, float16 or bfloat16; reads
return float32.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

# safetensors returns BF16 slices as numpy arrays of ml_dtypes' bfloat16; importing
# ml_dtypes (a JAX dependency) registers that dtype with numpy.
import ml_dtypes  # noqa: F401
import numpy as np
from safetensors import safe_open

from medha_jax.checkpoint.tensors import (
    Checkpoint, CheckpointError, StoredTensor, canonical_tensors)
from medha_jax.checkpoint.tokenizer import Tokenizer
from medha_jax.config import (
    FAMILIES, FULL_LAYER, SLIDING_LAYER, LinearScaling, ModelConfig, RopeScaling, YarnScaling)
from medha_jax.model.params import checkpoint_names

# Canonical name -> the tensor name in a *ForCausalLM state dict (from the parameter table).
HF_NAMES = checkpoint_names("hf")

# config.json `architectures` -> family (config.FAMILIES).
SUPPORTED_ARCHITECTURES = {f.hf_architecture: f.name for f in FAMILIES.values()}
# Multimodal architectures served text-only -> their text model's architecture.
TEXT_TOWER_ARCHITECTURES = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
# Where a multimodal checkpoint keeps its text tower's tensors -> the *ForCausalLM prefix:
# released checkpoints (and transformers' save_pretrained) `language_model.model.*`,
# transformers 4.52 to 4.5x's own layout `model.language_model.*` with a top-level lm_head.
_TEXT_TOWER_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                        "language_model.lm_head.": "lm_head."}
# The vision tower and its projection into the text model's embedding: not loaded.
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")
# Gemma3TextConfig's defaults that the code below does not already take: the released
# multimodal checkpoints' text_config lists only what differs from them (the 4B's: hidden
# and intermediate size, layers, rope scaling, window), and head_dim and num_key_value_heads
# are not derived from the heads as for the other families.
_GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216,
                             num_hidden_layers=26, num_attention_heads=8,
                             num_key_value_heads=4, head_dim=256,
                             max_position_embeddings=131_072)
_HF_DEFAULT_ROPE_THETA = 10_000.0   # LlamaConfig's default when config.json omits it
# Gemma3TextConfig's defaults: the full layers' and the sliding layers' RoPE base.
_GEMMA_DEFAULT_ROPE_THETA, _GEMMA_DEFAULT_LOCAL_ROPE_THETA = 1_000_000.0, 10_000.0


def load_hf_checkpoint(path: str | pathlib.Path) -> Checkpoint:
    """Loads a Hugging Face checkpoint directory of a supported family, lazily."""
    path = pathlib.Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json (not a Hugging Face checkpoint dir)")
    hf = json.loads(config_file.read_text())
    config = config_from_hf(hf, name=path.name)
    stored = _stored_tensors(path)
    if _text_tower_architecture(hf) is not None:
        stored = _text_tower_tensors(stored)
    tensors = canonical_tensors(
        config, stored, "hf",
        # Old checkpoints carry RoPE's inverse frequencies as a buffer; tied ones may still
        # hold a copy of the embedding as lm_head.
        ignored=lambda name: name.endswith("rotary_emb.inv_freq") or (
            config.tie_word_embeddings and name == HF_NAMES["lm_head"]))
    tokenizer_file = path / "tokenizer.json"
    tokenizer = Tokenizer.from_file(tokenizer_file) if tokenizer_file.is_file() else None
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer)


def _text_tower_architecture(hf: dict[str, Any]) -> str | None:
    """The multimodal architecture of a config.json served by its text tower, or None."""
    return next((a for a in hf.get("architectures") or [] if a in TEXT_TOWER_ARCHITECTURES),
                None)


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config.json's text model as a *ForCausalLM config.json would state it:
    its text_config, with the architecture of the text model and the top level's dtype and
    tie_word_embeddings where text_config leaves them out."""
    multimodal = _text_tower_architecture(hf)
    if multimodal is None:
        return hf
    if not isinstance(hf.get("text_config"), dict):
        raise CheckpointError(f"config.json of {multimodal} has no text_config")
    text = {**hf["text_config"], "architectures": [TEXT_TOWER_ARCHITECTURES[multimodal]]}
    if text.get("final_logit_softcapping") is not None:
        # transformers' Gemma3ForConditionalGeneration does not apply it (its text model
        # does): which one a checkpoint means is unclear; the releases leave it unset.
        raise CheckpointError(
            f"config.json text_config.final_logit_softcapping="
            f"{text['final_logit_softcapping']!r} in a {multimodal} checkpoint is not "
            "supported (transformers' multimodal model ignores it, its text model applies it)")
    for key in ("dtype", "torch_dtype", "tie_word_embeddings"):
        if text.get(key) is None and hf.get(key) is not None:
            text[key] = hf[key]
    return text


def _text_tower_tensors(stored: dict[str, StoredTensor]) -> dict[str, StoredTensor]:
    """A multimodal checkpoint's text tower under its *ForCausalLM names; the vision
    tower's tensors dropped, any other name kept (so an unknown one is still an error)."""
    text: dict[str, StoredTensor] = {}
    for name, tensor in stored.items():
        if name.startswith(_VISION_PREFIXES):
            continue
        prefix = next((p for p in _TEXT_TOWER_PREFIXES if name.startswith(p)), None)
        renamed = name if prefix is None else _TEXT_TOWER_PREFIXES[prefix] + name[len(prefix):]
        if renamed in text:
            raise CheckpointError(f"tensor {name!r} is stored twice (as {renamed!r} too)")
        text[renamed] = tensor
    return text


def config_from_hf(hf: dict[str, Any], name: str = "custom") -> ModelConfig:
    """ModelConfig from the dict of a config.json (transformers 4 or 5 spelling); of a
    multimodal one (TEXT_TOWER_ARCHITECTURES), its text model's."""
    hf = _text_config(hf)
    architectures = hf.get("architectures") or []
    families = [SUPPORTED_ARCHITECTURES[a] for a in architectures if a in SUPPORTED_ARCHITECTURES]
    if not families:
        raise CheckpointError(
            f"config.json architectures={architectures!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}, and the text towers of "
            f"{', '.join(TEXT_TOWER_ARCHITECTURES)}")
    family = families[0]
    gemma = family == "gemma3"
    if gemma:
        hf = {**hf, **{k: v for k, v in _GEMMA3_TEXT_DEFAULTS.items() if hf.get(k) is None}}
    # Gemma names its activation hidden_activation (GeGLU's tanh GELU); the others hidden_act.
    act_key, act = (("hidden_activation", "gelu_pytorch_tanh") if gemma else ("hidden_act", "silu"))
    if hf.get(act_key, act) != act:
        raise CheckpointError(f"config.json {act_key}={hf[act_key]!r}: only {act!r} is "
                              f"supported for {family}")
    for flag in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if hf.get(flag):
            raise CheckpointError(f"config.json {flag}={hf[flag]!r} is not supported "
                                  "(Gemma-3 releases leave it unset)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise CheckpointError(f"config.json {flag}=true: biases are not supported "
                                  "(beyond Qwen2's q/k/v biases)")

    def required(key: str) -> Any:
        if hf.get(key) is None:
            raise CheckpointError(f"config.json is missing {key!r}")
        return hf[key]

    hidden, heads = required("hidden_size"), required("num_attention_heads")
    # transformers 5 keeps theta and scaling in `rope_parameters`; 4 in rope_theta/rope_scaling.
    rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(rope_key) or {}
    local_rope_theta, layer_types = None, None
    if gemma:
        rope, rope_key, local_rope_theta = _gemma_rope(hf, rope, rope_key)
        layer_types = _gemma_layer_types(hf, required("num_hidden_layers"))
    rope_theta = hf.get("rope_theta") or rope.get("rope_theta") or (
        _GEMMA_DEFAULT_ROPE_THETA if gemma else _HF_DEFAULT_ROPE_THETA)
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    max_positions = hf.get("max_position_embeddings", 2048)
    try:
        return ModelConfig(
            name=name,
            family=family,
            vocab_size=required("vocab_size"),
            hidden_size=hidden,
            num_layers=required("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            intermediate_size=required("intermediate_size"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=_rope_scaling(rope, rope_key, max_positions),
            max_position_embeddings=max_positions,
            sliding_window=_sliding_window(hf, family),
            layer_types=layer_types,
            local_rope_theta=local_rope_theta,
            query_pre_attn_scalar=(float(hf.get("query_pre_attn_scalar", 256)) if gemma
                                   else None),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "float32",
        )
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"config.json: {e}") from e


def _sliding_window(hf: dict[str, Any], family: str) -> int | None:
    """Mistral: `sliding_window` (null: none). Qwen2/3 apply theirs only with
    use_sliding_window, then to layers from max_window_layers on: not supported."""
    window = hf.get("sliding_window")
    if family == "mistral":
        return window
    if family == "gemma3":
        return hf.get("sliding_window", 4096)   # Gemma3TextConfig's default
    if family in ("qwen2", "qwen3") and hf.get("use_sliding_window") and window is not None:
        if hf.get("max_window_layers", 28) < hf.get("num_hidden_layers", 0):
            raise CheckpointError(
                "config.json use_sliding_window=true: per-layer sliding windows "
                "(layers from max_window_layers on) are not supported")
    return None


def _gemma_rope(hf: dict[str, Any], rope: dict[str, Any],
                rope_key: str) -> tuple[dict[str, Any], str, float]:
    """Gemma-3's two RoPEs -> (the full layers' rope dict, its key, the sliding layers'
    theta). transformers 5: rope_parameters per layer type; 4: rope_theta and rope_scaling
    for the full layers, rope_local_base_freq for the sliding ones (unscaled)."""
    if "full_attention" in rope or "sliding_attention" in rope:
        local = rope.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise CheckpointError(
                f"config.json {rope_key}.sliding_attention.rope_type={local['rope_type']!r}: "
                "only 'default' is supported for the sliding layers")
        return (rope.get("full_attention") or {}, f"{rope_key}.full_attention",
                float(local.get("rope_theta", _GEMMA_DEFAULT_LOCAL_ROPE_THETA)))
    return rope, rope_key, float(hf.get("rope_local_base_freq", _GEMMA_DEFAULT_LOCAL_ROPE_THETA))


def _gemma_layer_types(hf: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """layer_types, or transformers 4's sliding_window_pattern (every n-th layer full)."""
    if hf.get("layer_types") is not None:
        return tuple(hf["layer_types"])
    pattern = hf.get("sliding_window_pattern", 6)
    return tuple(FULL_LAYER if (i + 1) % pattern == 0 else SLIDING_LAYER
                 for i in range(num_layers))


def _yarn(rope: dict[str, Any], key: str, max_positions: int) -> YarnScaling:
    """transformers' reading of a yarn rope_scaling: original_max_position_embeddings
    defaults to max_position_embeddings, factor to their ratio; attention_factor from
    factor (and mscale / mscale_all_dim) when absent."""
    original = rope.get("original_max_position_embeddings") or max_positions
    factor = rope.get("factor") or max_positions / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            attention_factor = (mscale(factor, rope["mscale"])
                                / mscale(factor, rope["mscale_all_dim"]))
        else:
            attention_factor = mscale(factor)
    try:
        return YarnScaling(factor=float(factor), original_max_position_embeddings=int(original),
                           beta_fast=float(rope.get("beta_fast") or 32),
                           beta_slow=float(rope.get("beta_slow") or 1),
                           attention_factor=float(attention_factor),
                           truncate=bool(rope.get("truncate", True)))
    except ValueError as e:
        raise CheckpointError(f"config.json {key}: {e}") from e


def _rope_scaling(rope: dict[str, Any], key: str,
                  max_positions: int) -> RopeScaling | YarnScaling | LinearScaling | None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "yarn":
        return _yarn(rope, key, max_positions)
    if rope_type == "linear":
        try:
            return LinearScaling(factor=float(rope["factor"]))
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"config.json {key} (linear) needs a factor > 0: {e}") from e
    if rope_type != "llama3":
        raise CheckpointError(
            f"config.json {key}.rope_type={rope_type!r} is not supported "
            "(only 'llama3', 'yarn', 'linear' or 'default')")
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [f for f in fields if f not in rope]
    if missing:
        raise CheckpointError(f"config.json {key} (llama3) is missing {missing}")
    try:
        return RopeScaling(**{f: rope[f] for f in fields})
    except ValueError as e:
        raise CheckpointError(f"config.json {key}: {e}") from e


def _stored_tensors(path: pathlib.Path) -> dict[str, StoredTensor]:
    """Every tensor in the directory's safetensors files, as a lazy StoredTensor."""
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path} has no *.safetensors files")
        weight_map = None

    stored: dict[str, StoredTensor] = {}
    for file in files:
        if not (path / file).is_file():
            raise CheckpointError(f"{index_file.name} names {file!r}, which is not in {path}")
        # The handle stays open (memory-mapped) for as long as a reader refers to it.
        handle = safe_open(str(path / file), framework="numpy")
        for name in handle.keys():
            if weight_map is not None and weight_map.get(name) != file:
                continue
            if name in stored:
                raise CheckpointError(f"tensor {name!r} appears in more than one safetensors file")
            shape = tuple(handle.get_slice(name).get_shape())
            stored[name] = StoredTensor(shape, _slice_reader(handle, name))
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(stored))
        if absent:
            raise CheckpointError(f"missing tensor {absent[0]!r}: indexed but not in its file")
    return stored


def _slice_reader(handle, name: str):
    def read(idx: tuple[slice, ...]) -> np.ndarray:
        return handle.get_slice(name)[idx].astype(np.float32)
    return read
