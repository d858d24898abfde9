"""GGUF checkpoints: the embedded SmolLM2 file against transformers' GGUF loader, tiny files
written here the way llama.cpp's converter writes them, lazy reads, and errors."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from medha_jax.checkpoint import (
    CheckpointError, default_model_path, load_gguf_checkpoint)
from medha_jax.checkpoint.hf import HF_NAMES
from medha_jax.config import LinearScaling, YarnScaling, model_preset
from medha_jax.model.params import param_specs
from tests.test_checkpoint_hf import canonical_from_state_dict, random_state_dict


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: Q/K rows into interleaved-rope order."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_tiny_gguf(path, config, sd, *, qtype=GGMLQuantizationType.F32, arch="llama",
                    skip_metadata=(), tensor_overrides=None):
    """A GGUF of `sd` (Hugging Face names) as llama.cpp's converter would write it: metadata
    under `arch`, Q/K rows (and biases) permuted for the interleaved RoPE of "llama",
    Gemma-3's norms stored as 1 + w and its full layers' linear RoPE scaling."""
    writer = GGUFWriter(str(path), arch)
    metadata = {
        "block_count": config.num_layers, "context_length": 2048,
        "embedding_length": config.hidden_size,
        "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_heads,
        "attention.head_count_kv": config.num_kv_heads,
        "rope.dimension_count": config.head_dim,
        "attention.key_length": config.head_dim,
    }
    if config.sliding_window is not None:
        metadata["attention.sliding_window"] = config.sliding_window
    for key, value in metadata.items():
        if f"{arch}.{key}" not in skip_metadata:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", config.rope_theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    if isinstance(config.rope_scaling, LinearScaling):
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", config.rope_scaling.factor)
    if isinstance(config.rope_scaling, YarnScaling):
        # What the converter writes for a yarn rope_scaling without beta or attention
        # factors of its own (Qwen2.5's): llama.cpp derives the rest from the factor.
        yarn = config.rope_scaling
        writer.add_string(f"{arch}.rope.scaling.type", "yarn")
        writer.add_float32(f"{arch}.rope.scaling.factor", yarn.factor)
        writer.add_uint32(f"{arch}.rope.scaling.original_context_length",
                          yarn.original_max_position_embeddings)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(config.vocab_size)])
    if config.final_logit_softcapping is not None:
        writer.add_float32(f"{arch}.final_logit_softcapping", config.final_logit_softcapping)
    tensors = {}
    # The config's rows with their own names (Gemma renames Llama's mlp_norm); no lm_head
    # when tied, as the converter writes (a tied state dict may still hold one).
    for key, spec in param_specs(config).items():
        hf_name, gguf_name = spec.hf_name, spec.gguf_name
        names = ([(hf_name.format(layer=i), gguf_name.format(layer=i))
                  for i in range(config.num_layers)] if spec.per_layer
                 else [(hf_name, gguf_name)])
        for hf, gguf_name in names:
            if hf not in sd:
                continue
            array = sd[hf]
            if config.family_spec.norm_offset and hf.endswith("norm.weight"):
                array = array + np.float32(config.family_spec.norm_offset)
            if arch == "llama" and key in ("layers.wq", "layers.bq"):
                array = llama_cpp_permute(array, config.num_heads)
            elif arch == "llama" and key in ("layers.wk", "layers.bk"):
                array = llama_cpp_permute(array, config.num_kv_heads)
            tensors[gguf_name] = array
    tensors.update(tensor_overrides or {})
    for name, array in tensors.items():
        if array.ndim == 2 and array.dtype == np.float32 and qtype != GGMLQuantizationType.F32:
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- Tiny files: the un-permutation and dequantization, exactly -----------------------------

@pytest.mark.parametrize("preset", ["tiny", "tiny-tied"])
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0],
                         ids=["F32", "Q8_0"])
def test_tiny_gguf_gives_the_hf_layout(tmp_path, preset, qtype):
    config = model_preset(preset)
    sd = random_state_dict(config, seed=1)
    ckpt = load_gguf_checkpoint(write_tiny_gguf(tmp_path / "m.gguf", config, sd, qtype=qtype))
    assert ckpt.config.tie_word_embeddings == config.tie_word_embeddings
    assert (ckpt.config.num_heads, ckpt.config.num_kv_heads, ckpt.config.head_dim) == (
        config.num_heads, config.num_kv_heads, config.head_dim)
    assert ckpt.tokenizer is None   # the file has tokens but no tokenizer.ggml.model
    if qtype != GGMLQuantizationType.F32:   # what the file holds is the quantized weight
        sd = {k: dequantize(quantize(v, qtype), qtype) if v.ndim == 2 else v
              for k, v in sd.items()}
    for name, want in canonical_from_state_dict(sd, config).items():
        np.testing.assert_array_equal(ckpt.tensors[name].read_all(), want, err_msg=name)


@pytest.mark.parametrize("case, message", [
    ("arch", "general.architecture='gpt2'"),
    ("missing", "blk.1.ffn_up.weight"),
    ("shape", "blk.0.attn_k.weight"),
    ("quant", "'blk.0.attn_v.weight' has quantization type I32"),
    ("metadata", "llama.feed_forward_length"),
    ("rope_freqs", "rope_freqs.weight"),
])
def test_errors_name_the_tensor_or_field(tmp_path, case, message):
    config = model_preset("tiny")
    sd = random_state_dict(config)
    kwargs = {}
    if case == "arch":
        kwargs["arch"] = "gpt2"
    elif case == "missing":
        del sd[HF_NAMES["layers.w_up"].format(layer=1)]
    elif case == "shape":
        kwargs["tensor_overrides"] = {"blk.0.attn_k.weight": np.zeros((16, 64), np.float32)}
    elif case == "quant":   # a type gguf.quants.dequantize cannot turn into floats
        kwargs["tensor_overrides"] = {"blk.0.attn_v.weight": np.zeros((32, 64), np.int32)}
    elif case == "metadata":
        kwargs["skip_metadata"] = ("llama.feed_forward_length",)
    elif case == "rope_freqs":
        kwargs["tensor_overrides"] = {"rope_freqs.weight": np.ones(8, np.float32)}
    path = write_tiny_gguf(tmp_path / "m.gguf", config, sd, **kwargs)
    with pytest.raises(CheckpointError, match=message.replace(".", r"\.")):
        load_gguf_checkpoint(path)


# --- The embedded SmolLM2-135M-Instruct file -------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    return load_gguf_checkpoint(default_model_path())


def test_default_model_path_is_the_smollm2_gguf():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_smollm2_config_is_the_preset_shape(smollm2):
    preset = model_preset("smollm2-135m")
    ours = smollm2.config
    for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "intermediate_size", "rope_theta", "max_position_embeddings",
                  "tie_word_embeddings", "rope_scaling"):
        assert getattr(ours, field) == getattr(preset, field), field
    assert ours.rms_norm_eps == pytest.approx(1e-5)
    assert "lm_head" not in smollm2.tensors and smollm2.tokenizer is not None


@pytest.mark.parametrize("name, index", [
    ("layers.wq", (slice(4, 6), slice(100, 300), slice(2, 5), slice(16, 48))),
    ("layers.wk", (slice(29, 30), slice(None), slice(1, 2), slice(None, None, 3))),
    ("layers.wo", (slice(0, 2), slice(3, 9), slice(None), slice(500, None))),
    ("layers.w_down", (slice(7, 9), slice(1000, 1100), slice(None))),
    ("embed", (slice(49000, None), slice(20, 40))),
    ("layers.mlp_norm", (slice(2, 5), slice(10, 20))),
])
def test_smollm2_lazy_slices_equal_slices_of_the_full_tensor(smollm2, name, index):
    source = smollm2.tensors[name]
    full_layers = source.read((index[0],))   # every other dim in full
    np.testing.assert_array_equal(source.read(index),
                                  full_layers[(slice(None),) + index[1:]])


@pytest.fixture(scope="module")
def transformers_smollm2_state_dict():
    from transformers import LlamaForCausalLM

    path = default_model_path()
    model = LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


@pytest.mark.hf
@pytest.mark.slow   # transformers parses and dequantizes the whole file (~15 s on 2 cores)
def test_smollm2_tensors_equal_transformers_gguf_load(smollm2, transformers_smollm2_state_dict):
    sd = transformers_smollm2_state_dict
    config = smollm2.config
    hd, D = config.head_dim, config.hidden_size
    # Including a Q and a K projection, whose rows llama.cpp permuted and both loaders undo.
    for layer in (0, 17, 29):
        index = (slice(layer, layer + 1),)
        for key in ("wq", "wk", "wv"):
            hf = sd[HF_NAMES[f"layers.{key}"].format(layer=layer)]           # [heads * hd, D]
            want = hf.T.reshape(D, -1, hd)[None]
            np.testing.assert_allclose(smollm2.tensors[f"layers.{key}"].read(index), want,
                                       rtol=0, atol=1e-6, err_msg=f"{key} layer {layer}")
        hf = sd[HF_NAMES["layers.wo"].format(layer=layer)]              # [D, heads * hd]
        np.testing.assert_allclose(smollm2.tensors["layers.wo"].read(index),
                                   hf.T.reshape(-1, hd, D)[None], rtol=0, atol=1e-6)
        for key in ("w_gate", "w_up", "w_down"):
            hf = sd[HF_NAMES[f"layers.{key}"].format(layer=layer)]
            np.testing.assert_allclose(smollm2.tensors[f"layers.{key}"].read(index), hf.T[None],
                                       rtol=0, atol=1e-6, err_msg=f"{key} layer {layer}")
        for key in ("attn_norm", "mlp_norm"):
            np.testing.assert_array_equal(smollm2.tensors[f"layers.{key}"].read(index),
                                          sd[HF_NAMES[f"layers.{key}"].format(layer=layer)][None])
    np.testing.assert_allclose(smollm2.tensors["embed"].read_all(), sd[HF_NAMES["embed"]],
                               rtol=0, atol=1e-6)
    np.testing.assert_array_equal(smollm2.tensors["final_norm"].read_all(),
                                  sd[HF_NAMES["final_norm"]])
