"""The families beside Llama (config.FAMILIES) against transformers: Hugging Face
directories and GGUF files of random tiny checkpoints, at tp=1 and tp=2, one-shot and in
chunks, and the config fields that pick and shape each family."""

import numpy as np
import pytest

from medha_jax import ParallelConfig, load_model
from medha_jax.checkpoint import CheckpointError, load_gguf_checkpoint
from medha_jax.checkpoint.hf import config_from_hf
from medha_jax.config import LinearScaling, YarnScaling, model_preset
from tests.hf_oracle import (TINY_FAMILY_CONFIGS, greedy_with_logits, hf_greedy, hf_logits,
                             save_tiny_family)

pytestmark = pytest.mark.hf

# Longer than the Mistral and Gemma-3 configs' sliding window (24), so the window masks keys.
PROMPT_LEN = 61
# float32 logits; Gemma-3's are held to the tighter bound its brief asks (measured ~2e-6).
TOLERANCE = {"gemma3": 1e-5}


@pytest.fixture(scope="module", params=sorted(TINY_FAMILY_CONFIGS))
def family_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, save_tiny_family(path, request.param)


@pytest.mark.parametrize("tp", [1, 2])
def test_logits_and_greedy_tokens_match_transformers(family_checkpoint, tp):
    name, path, hf_model = family_checkpoint
    model = load_model(path, parallel=ParallelConfig(tp=tp), verbose=False)
    assert model.config.family == name.split("-")[0]
    ids = np.random.default_rng(1).integers(0, 256, size=PROMPT_LEN).tolist()
    want = hf_logits(hf_model, ids)
    tol = TOLERANCE.get(name, 1e-4)
    np.testing.assert_array_less(np.abs(model.logits(ids) - want).max(), tol)
    # Chunked prefill and decodes (chunks of 1) through the paged cache.
    chunked = model.logits(ids, chunk_sizes=[20, 1, 1, 30, 9], page_size=8)
    np.testing.assert_array_less(np.abs(chunked - want).max(), tol)
    prompt = ids[:30]
    assert greedy_with_logits(model, prompt, 6) == hf_greedy(hf_model, prompt, 6)


def test_gguf_of_the_checkpoint_gives_the_same_logits(family_checkpoint, tmp_path):
    from tests.test_checkpoint_gguf import write_tiny_gguf

    name, path, hf_model = family_checkpoint
    if name == "gemma3":
        # llama.cpp's converter writes neither the layer pattern nor query_pre_attn_scalar:
        # it assumes every 6th layer full and head_dim (but on the 27B).
        path = tmp_path / "hf"
        hf_model = save_tiny_family(path, name, num_hidden_layers=6, layer_types=None,
                                    query_pre_attn_scalar=32)
    config = load_model(path, verbose=False).config
    sd = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    arch = {"qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}.get(config.family, "llama")
    # llama.cpp's Gemma-3 converter writes key_length and no rope.dimension_count.
    gguf = write_tiny_gguf(tmp_path / "m.gguf", config, sd, arch=arch,
                           skip_metadata=("gemma3.rope.dimension_count",))
    ckpt = load_gguf_checkpoint(gguf)
    assert (ckpt.config.family, ckpt.config.sliding_window, ckpt.config.head_dim) == (
        "llama" if config.family == "mistral" else config.family, config.sliding_window,
        config.head_dim)
    fields = ("layer_types", "local_rope_theta", "rope_scaling", "query_pre_attn_scalar",
              "final_logit_softcapping", "tie_word_embeddings")
    assert [getattr(ckpt.config, f) for f in fields] == [getattr(config, f) for f in fields]
    model = load_model(gguf, verbose=False)
    ids = np.random.default_rng(5).integers(0, 256, size=PROMPT_LEN).tolist()
    np.testing.assert_array_less(np.abs(model.logits(ids) - hf_logits(hf_model, ids)).max(), 1e-4)


def _hf(arch, **fields):
    return {"architectures": [arch], "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 16, **fields}


def test_config_fields_of_each_family():
    assert config_from_hf(_hf("LlamaForCausalLM")).family == "llama"
    qwen2 = config_from_hf(_hf("Qwen2ForCausalLM", rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        max_position_embeddings=131072, rope_theta=1e6))
    assert qwen2.family == "qwen2" and qwen2.rope_theta == 1e6
    assert qwen2.rope_scaling == YarnScaling(factor=4.0, original_max_position_embeddings=32768,
                                             attention_factor=0.1 * np.log(4.0) + 1)
    # Qwen's sliding window applies only with use_sliding_window (then per layer: refused).
    assert config_from_hf(_hf("Qwen3ForCausalLM", sliding_window=4096)).sliding_window is None
    with pytest.raises(CheckpointError, match="use_sliding_window"):
        config_from_hf(_hf("Qwen2ForCausalLM", sliding_window=4, use_sliding_window=True,
                           max_window_layers=0))
    mistral = config_from_hf(_hf("MistralForCausalLM", sliding_window=4096, head_dim=128))
    assert (mistral.family, mistral.sliding_window, mistral.head_dim) == ("mistral", 4096, 128)
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel.*LlamaForCausalLM.*"
                                              "Qwen2ForCausalLM.*Qwen3ForCausalLM.*Gemma3"):
        config_from_hf(_hf("GPT2LMHeadModel"))


def test_gemma3_config_fields_in_transformers_4_spelling():
    """Gemma-3's config.json as released: sliding_window_pattern, rope_local_base_freq and the
    full layers' linear rope_scaling (transformers 5 reads the same file the same way)."""
    import transformers

    fields = dict(num_hidden_layers=7, num_key_value_heads=1, head_dim=4, rope_theta=1e6,
                  rope_local_base_freq=1e4,
                  sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256,
                  rope_scaling={"rope_type": "linear", "factor": 8.0},
                  hidden_activation="gelu_pytorch_tanh", max_position_embeddings=2048)
    gemma = config_from_hf(_hf("Gemma3ForCausalLM", **fields))
    assert gemma.layer_types == ("sliding_attention",) * 5 + ("full_attention",
                                                              "sliding_attention")
    assert (gemma.sliding_window, gemma.local_rope_theta, gemma.rope_theta) == (512, 1e4, 1e6)
    assert gemma.rope_scaling == LinearScaling(8.0) and gemma.attention_scale == 1 / 16
    assert gemma.tie_word_embeddings and gemma.final_logit_softcapping is None
    theirs = transformers.Gemma3TextConfig(**{k: v for k, v in _hf("", **fields).items()
                                              if k != "architectures"})
    assert gemma.layer_types == tuple(theirs.layer_types)
    assert gemma == config_from_hf({**theirs.to_dict(), "architectures": ["Gemma3ForCausalLM"]})
    # Gemma-3-1B's released config.json reads as the preset.
    released = {
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
        "intermediate_size": 6912, "max_position_embeddings": 32768,
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
        "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144}
    assert config_from_hf(released, name="gemma3-1b") == model_preset("gemma3-1b")
    for bad, match in (({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
                       ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
                       ({"hidden_activation": "gelu"}, "hidden_activation='gelu'")):
        with pytest.raises(CheckpointError, match=match):
            config_from_hf(_hf("Gemma3ForCausalLM", **{**fields, **bad}))


@pytest.mark.slow   # a Server start compiles its step shapes (~30 s per family on 2 cores)
def test_server_mixed_batch_greedy_equals_transformers(family_checkpoint):
    """Decodes beside prefill chunks in the engine's steps (prompts longer than Mistral's
    window among short ones)."""
    from medha_jax import SamplingParams, Server
    from tests.test_server import TINY_ENGINE

    _, path, hf_model = family_checkpoint
    prompts = [[1, 2, 3, 4, 5], list(range(30, 30 + PROMPT_LEN)), [17] * 3]
    with Server(str(path), engine_config=TINY_ENGINE) as server:
        outs = server.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == hf_greedy(hf_model, prompt, 8), prompt


def test_gemma3_pipeline_stages_keep_each_layers_kind(tmp_path):
    """spp = 3 over [sliding, full, sliding]: each stage scans its own layers' kinds (the
    full layer is the middle stage's first), so the staged logits equal transformers'."""
    from medha_jax.model.stages import split_stages
    from tests.test_stages import staged_logits

    hf_model = save_tiny_family(tmp_path, "gemma3")
    model = load_model(tmp_path, parallel=ParallelConfig(spp=3), verbose=False)
    ids = np.random.default_rng(2).integers(0, 256, size=PROMPT_LEN).tolist()
    staged = staged_logits(split_stages(model), ids, [29, 1, 31])
    np.testing.assert_array_less(np.abs(staged - hf_logits(hf_model, ids)).max(), 1e-5)


@pytest.mark.parametrize("layers, pattern, scalar", [(3, [True, False, True], 32.0),
                                                     (62, None, 16.0)])
def test_gemma3_gguf_fields_as_llama_cpp_reads_them(tmp_path, layers, pattern, scalar):
    """A written sliding_window_pattern (flags per layer) and rope.freq_base_swa are read;
    without them every 6th layer is full on base 1e4; the 27B's (62 layers) attention scale
    is hidden / heads, every other size's head_dim; head_dim is key_length (32, not hidden /
    heads), with no rope.dimension_count written, as the converter writes Gemma-3."""
    from gguf import GGUFReader, GGUFWriter

    from medha_jax.checkpoint.gguf_file import config_from_gguf

    writer = GGUFWriter(str(tmp_path / "m.gguf"), "gemma3")
    for key, value in {"block_count": layers, "context_length": 2048, "embedding_length": 64,
                       "feed_forward_length": 128, "attention.head_count": 4,
                       "attention.head_count_kv": 2, "attention.key_length": 32,
                       "attention.sliding_window": 24}.items():
        writer.add_uint32(f"gemma3.{key}", value)
    writer.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("gemma3.rope.freq_base", 1e6)
    if pattern is not None:
        writer.add_sliding_window_pattern(pattern)
        writer.add_rope_freq_base_swa(5e3)
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(16)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = config_from_gguf(GGUFReader(tmp_path / "m.gguf"))
    want = pattern or [(i + 1) % 6 != 0 for i in range(layers)]
    assert config.sliding_layers() == tuple(want)
    assert config.local_rope_theta == (5e3 if pattern else 1e4)
    assert config.query_pre_attn_scalar == scalar and config.tie_word_embeddings
    assert config.head_dim == 32


# ------------------------------------------ Gemma-3 4B and up: Gemma3ForConditionalGeneration

def _model_language_model_layout(src, dst):
    """The checkpoint at `src` rewritten in transformers 4.52+'s own layout of a
    Gemma3ForConditionalGeneration state dict: model.language_model.*, model.vision_tower.*,
    model.multi_modal_projector.* (the released checkpoints keep language_model.model.*)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        save_file({("model." + name.replace("language_model.model.", "language_model.", 1)
                    if not name.startswith("language_model.lm_head") else
                    name.replace("language_model.", "", 1)): t
                   for name, t in tensors.items()}, file, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def gemma3_multimodal(tmp_path_factory):
    from tests.hf_oracle import save_tiny_gemma3_multimodal

    path = tmp_path_factory.mktemp("gemma3-mm") / "released"
    return path, save_tiny_gemma3_multimodal(path)


@pytest.mark.parametrize("layout, tp", [
    ("released", 1), pytest.param("model.language_model", 2, marks=pytest.mark.slow)])
def test_gemma3_multimodal_checkpoint_serves_its_text_tower(gemma3_multimodal, layout, tp,
                                                            tmp_path):
    """Gemma-3 4B/12B/27B are Gemma3ForConditionalGeneration: the text tower loads from its
    text_config and language-model tensors (either layout), the vision tower's are left
    out, and a text-only prompt longer than the window gives transformers' logits (one-shot
    and chunked) and greedy tokens."""
    path, hf_model = gemma3_multimodal
    if layout != "released":
        path = _model_language_model_layout(path, tmp_path / "ckpt")
    model = load_model(path, parallel=ParallelConfig(tp=tp), verbose=False)
    assert model.config.family == "gemma3" and model.config.num_layers == 3
    ids = np.random.default_rng(1).integers(0, 253, size=PROMPT_LEN).tolist()  # no image ids
    want = hf_logits(hf_model, ids)
    np.testing.assert_array_less(np.abs(model.logits(ids) - want).max(), 1e-4)
    chunked = model.logits(ids, chunk_sizes=[20, 1, 1, 30, 9], page_size=8)
    np.testing.assert_array_less(np.abs(chunked - want).max(), 1e-4)
    assert greedy_with_logits(model, ids[:30], 6) == hf_greedy(hf_model, ids[:30], 6)


def test_gemma3_multimodal_config_as_released():
    """The 4B's config.json as released: its text_config states only what differs from
    Gemma3TextConfig's defaults, which fill the rest (as transformers reads it); a text
    soft-cap, which transformers' multimodal model would not apply, is refused."""
    import transformers

    from medha_jax.checkpoint.hf import _GEMMA3_TEXT_DEFAULTS

    defaults = transformers.Gemma3TextConfig()
    assert {k: getattr(defaults, k) for k in _GEMMA3_TEXT_DEFAULTS} == _GEMMA3_TEXT_DEFAULTS
    released_4b = {
        "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
        "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
        "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                        "model_type": "gemma3_text", "num_hidden_layers": 34,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16,
                          "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
    config = config_from_hf(released_4b, name="gemma-3-4b-it")
    theirs = transformers.Gemma3Config(**{k: v for k, v in released_4b.items()
                                          if k != "architectures"}).text_config
    assert config == config_from_hf({**theirs.to_dict(), "architectures": ["Gemma3ForCausalLM"],
                                     "dtype": "bfloat16"}, name="gemma-3-4b-it")
    assert (config.family, config.num_layers, config.num_heads, config.num_kv_heads,
            config.head_dim, config.vocab_size, config.sliding_window, config.dtype) == (
        "gemma3", 34, 8, 4, 256, 262_208, 1024, "bfloat16")
    assert config.sliding_layers() == tuple((i + 1) % 6 != 0 for i in range(34))
    assert config.rope_scaling == LinearScaling(8.0) and config.local_rope_theta == 1e4
    assert config.tie_word_embeddings and config.attention_scale == 1 / 16
    capped = {**released_4b, "text_config": {**released_4b["text_config"],
                                             "final_logit_softcapping": 30.0}}
    with pytest.raises(CheckpointError, match="text_config.final_logit_softcapping=30.0"):
        config_from_hf(capped)
