"""Hugging Face checkpoint directories: tensors equal transformers' state dict, lazy reads,
config parsing, and errors that name the tensor or field."""

import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from medha_jax.checkpoint import CheckpointError, load_hf_checkpoint
from medha_jax.checkpoint.hf import HF_NAMES, config_from_hf
from medha_jax.checkpoint.tensors import StoredTensor, canonical_tensors
from medha_jax.config import RopeScaling, model_preset


def canonical_from_state_dict(sd: dict[str, np.ndarray], config) -> dict[str, np.ndarray]:
    """The canonical layout, computed on whole stacked arrays (independent of the lazy path)."""
    L, D, H, K, hd = (config.num_layers, config.hidden_size, config.num_heads,
                      config.num_kv_heads, config.head_dim)

    def stack(key):   # [L, out, in]
        return np.stack([sd[HF_NAMES[f"layers.{key}"].format(layer=i)] for i in range(L)])

    out = {
        "embed": sd[HF_NAMES["embed"]],
        "final_norm": sd[HF_NAMES["final_norm"]],
        "layers.attn_norm": stack("attn_norm"),
        "layers.mlp_norm": stack("mlp_norm"),
        "layers.wq": stack("wq").transpose(0, 2, 1).reshape(L, D, H, hd),
        "layers.wk": stack("wk").transpose(0, 2, 1).reshape(L, D, K, hd),
        "layers.wv": stack("wv").transpose(0, 2, 1).reshape(L, D, K, hd),
        "layers.wo": stack("wo").transpose(0, 2, 1).reshape(L, H, hd, D),
        "layers.w_gate": stack("w_gate").transpose(0, 2, 1),
        "layers.w_up": stack("w_up").transpose(0, 2, 1),
        "layers.w_down": stack("w_down").transpose(0, 2, 1),
    }
    if not config.tie_word_embeddings:
        out["lm_head"] = sd[HF_NAMES["lm_head"]].T
    return out


def random_state_dict(config, seed=0) -> dict[str, np.ndarray]:
    """A random float32 Llama state dict in Hugging Face names and [out, in] shapes."""
    rng = np.random.default_rng(seed)
    D, F, V, hd = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    shapes = {"attn_norm": (D,), "mlp_norm": (D,), "wq": (q, D), "wk": (kv, D), "wv": (kv, D),
              "wo": (D, q), "w_gate": (F, D), "w_up": (F, D), "w_down": (D, F)}
    sd = {HF_NAMES["embed"]: (V, D), HF_NAMES["final_norm"]: (D,)}
    if not config.tie_word_embeddings:
        sd[HF_NAMES["lm_head"]] = (V, D)
    for i in range(config.num_layers):
        sd.update({HF_NAMES[f"layers.{key}"].format(layer=i): shape
                   for key, shape in shapes.items()})
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in sd.items()}


def hf_config_dict(config, **overrides) -> dict:
    """config.json as transformers 5 writes it for `config` (a ModelConfig)."""
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        rope.update(rope_type="llama3", **vars(config.rope_scaling))
    hf = dict(architectures=["LlamaForCausalLM"], model_type="llama",
              vocab_size=config.vocab_size, hidden_size=config.hidden_size,
              num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
              num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
              intermediate_size=config.intermediate_size, rms_norm_eps=config.rms_norm_eps,
              max_position_embeddings=config.max_position_embeddings,
              tie_word_embeddings=config.tie_word_embeddings, hidden_act="silu",
              rope_parameters=rope, dtype="float32")
    hf.update(overrides)
    return hf


def write_hf_dir(path, config_json: dict, tensors: dict[str, np.ndarray]):
    """A Hugging Face checkpoint dir written with numpy only (single safetensors file)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_json))
    save_file(tensors, str(path / "model.safetensors"))
    return path


# --- Against transformers ------------------------------------------------------------------

@pytest.fixture(scope="module", params=["gqa4-llama3-rope", "tied-embeddings"])
def hf_model_dir(request, tmp_path_factory):
    import torch

    from tests.hf_oracle import save_tiny_llama

    path = tmp_path_factory.mktemp(request.param)
    model = save_tiny_llama(path / "init", request.param)
    # Random norm weights (they start as ones), so the norms' comparison can fail.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_()
    # A small shard size forces several files and model.safetensors.index.json.
    model.save_pretrained(path / "ckpt", max_shard_size="50KB")
    state_dict = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return path / "ckpt", model.config, state_dict


@pytest.mark.hf
def test_every_canonical_tensor_equals_the_transformers_state_dict(hf_model_dir):
    path, hf_config, state_dict = hf_model_dir
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 2
    ckpt = load_hf_checkpoint(path)
    expected = canonical_from_state_dict(state_dict, ckpt.config)
    assert set(ckpt.tensors) == set(expected)
    assert ("lm_head" in ckpt.tensors) == (not hf_config.tie_word_embeddings)
    for name, want in expected.items():
        source = ckpt.tensors[name]
        assert source.shape == want.shape, name
        got = source.read_all()
        assert got.dtype == np.float32, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert ckpt.tokenizer is None   # save_tiny_llama writes no tokenizer.json


@pytest.mark.hf
def test_config_matches_transformers(hf_model_dir):
    path, hf_config, _ = hf_model_dir
    config = load_hf_checkpoint(path).config
    assert config.vocab_size == hf_config.vocab_size
    assert config.hidden_size == hf_config.hidden_size
    assert config.num_layers == hf_config.num_hidden_layers
    assert config.num_heads == hf_config.num_attention_heads
    assert config.num_kv_heads == hf_config.num_key_value_heads
    assert config.head_dim == hf_config.head_dim
    assert config.intermediate_size == hf_config.intermediate_size
    assert config.rms_norm_eps == hf_config.rms_norm_eps
    assert config.max_position_embeddings == hf_config.max_position_embeddings
    assert config.tie_word_embeddings == hf_config.tie_word_embeddings
    rope = hf_config.rope_parameters
    assert config.rope_theta == rope["rope_theta"]
    if rope["rope_type"] == "llama3":
        assert config.rope_scaling == RopeScaling(
            factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"],
            original_max_position_embeddings=rope["original_max_position_embeddings"])
    else:
        assert config.rope_scaling is None


@pytest.mark.hf
def test_lazy_slices_equal_slices_of_the_full_tensor(hf_model_dir):
    path, _, _ = hf_model_dir
    ckpt = load_hf_checkpoint(path)
    rng = np.random.default_rng(0)
    for name, source in ckpt.tensors.items():
        full = source.read_all()
        for _ in range(4):
            index = []
            for n in source.shape:
                start, stop = sorted(rng.integers(0, n + 1, size=2))
                index.append(slice(int(start), int(stop) if stop > start else None))
            index = tuple(index)
            np.testing.assert_array_equal(source.read(index), full[index], err_msg=f"{name}{index}")
        # The forms jax.make_array_from_callback and users pass: a prefix, steps, empty.
        first = (slice(None, None, 2),) + (slice(1, None),) * (len(source.shape) - 1)
        for index in [(slice(1, 2),), first, (slice(1, 1),), (slice(None, None, -1),)]:
            np.testing.assert_array_equal(source.read(index), full[index], err_msg=f"{name}{index}")


# --- Laziness: a read touches only the layers and heads it needs --------------------------

def test_reads_touch_only_the_requested_layers_and_heads():
    config = model_preset("tiny")
    sd = random_state_dict(config)
    touched: list[tuple[str, tuple[slice, ...]]] = []

    def spy(name):
        def read(idx):
            touched.append((name, idx))
            return sd[name][idx]
        return read

    stored = {name: StoredTensor(array.shape, spy(name)) for name, array in sd.items()}
    tensors = canonical_tensors(config, stored, "hf")
    hd = config.head_dim
    # Layer 1 only, kv head 1 only, hidden rows 3..9.
    got = tensors["layers.wk"].read((slice(1, 2), slice(3, 10), slice(1, 2), slice(None)))
    assert touched == [(HF_NAMES["layers.wk"].format(layer=1), (slice(hd, 2 * hd), slice(3, 10)))]
    want = canonical_from_state_dict(sd, config)["layers.wk"][1:2, 3:10, 1:2, :]
    np.testing.assert_array_equal(got, want)
    touched.clear()
    tensors["layers.wo"].read((slice(0, 1), slice(2, 4), slice(None), slice(5, 6)))
    assert touched == [(HF_NAMES["layers.wo"].format(layer=0), (slice(5, 6), slice(2 * hd, 4 * hd)))]


# --- Without transformers: numpy-written directories ---------------------------------------

def test_numpy_written_dir_bfloat16_and_transformers4_config(tmp_path):
    config = model_preset("tiny")
    sd = random_state_dict(config, seed=3)
    sd_bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in sd.items()}
    # transformers 4 spelling: rope_theta and rope_scaling at top level, "type" not "rope_type".
    hf = hf_config_dict(config, dtype=None, torch_dtype="bfloat16", rope_parameters=None,
                        rope_theta=config.rope_theta,
                        rope_scaling={"type": "llama3", **vars(config.rope_scaling)})
    ckpt = load_hf_checkpoint(write_hf_dir(tmp_path, hf, sd_bf16))
    assert ckpt.config == config.__class__(**{**vars(config), "name": tmp_path.name,
                                              "dtype": "bfloat16"})
    expected = canonical_from_state_dict(
        {k: v.astype(np.float32) for k, v in sd_bf16.items()}, config)
    for name, want in expected.items():
        np.testing.assert_array_equal(ckpt.tensors[name].read_all(), want, err_msg=name)


def test_tokenizer_json_in_the_dir_is_loaded(tmp_path):
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    config = model_preset("tiny-tied")
    write_hf_dir(tmp_path, hf_config_dict(config), random_state_dict(config))
    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate("abcdefgh ")}, "ab": 11}
    backend = HfTokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["<s>", "</s>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    tok = load_hf_checkpoint(tmp_path).tokenizer
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (0, (1,), 12)
    assert tok.encode("abc ab") == [11, 4, 10, 11]
    assert tok.encode("abc", add_bos=True) == [0, 11, 4]
    assert tok.decode([0, 11, 4, 1]) == "abc"


@pytest.mark.parametrize("case, message", [
    ("missing", "model.layers.1.mlp.up_proj.weight"),
    ("shape", "model.layers.0.self_attn.k_proj.weight"),
    ("bias", "model.layers.0.self_attn.q_proj.bias"),
    ("rope", "rope_parameters.rope_type='dynamic'"),
    ("arch", "GPT2LMHeadModel"),
    ("heads", "num_kv_heads=3"),
])
def test_errors_name_the_tensor_or_field(tmp_path, case, message):
    config = model_preset("tiny")
    sd = random_state_dict(config)
    hf = hf_config_dict(config)
    if case == "missing":
        del sd["model.layers.1.mlp.up_proj.weight"]
    elif case == "shape":
        sd["model.layers.0.self_attn.k_proj.weight"] = np.zeros((4, 64), np.float32)
    elif case == "bias":
        sd["model.layers.0.self_attn.q_proj.bias"] = np.zeros((128,), np.float32)
    elif case == "rope":
        hf["rope_parameters"] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}
    elif case == "arch":
        hf["architectures"] = ["GPT2LMHeadModel"]
    elif case == "heads":
        hf["num_key_value_heads"] = 3
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace(".", r"\.")):
        load_hf_checkpoint(write_hf_dir(tmp_path, hf, sd))


def test_config_defaults_and_missing_fields():
    config = config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 10,
                             "hidden_size": 8, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "intermediate_size": 16})
    assert (config.num_kv_heads, config.head_dim, config.rope_theta, config.rope_scaling) == (
        2, 4, 10_000.0, None)
    with pytest.raises(CheckpointError, match="'intermediate_size'"):
        config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 10,
                        "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2})
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf_checkpoint("/nonexistent/dir")
