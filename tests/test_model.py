"""The model against Hugging Face transformers, and on every mesh shape against one device."""

import json

import numpy as np
import pytest

from medha_jax import ParallelConfig, load_model
from tests.hf_oracle import TINY_HF_CONFIGS, greedy_with_logits, hf_greedy, hf_logits, save_tiny_llama

pytestmark = pytest.mark.hf


@pytest.fixture(scope="module", params=sorted(TINY_HF_CONFIGS))
def hf_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_tiny_llama(path, request.param)
    return path, hf_model


def test_logits_match_transformers(hf_checkpoint):
    path, hf_model = hf_checkpoint
    model = load_model(path)
    ids = np.random.default_rng(1).integers(0, 256, size=77).tolist()
    ours = model.logits(ids)
    assert ours.dtype == np.float32 and ours.shape == (77, 256)
    np.testing.assert_array_less(np.abs(ours - hf_logits(hf_model, ids)).max(), 1e-4)


def test_greedy_generation_matches_transformers(hf_checkpoint):
    path, hf_model = hf_checkpoint
    model = load_model(path)
    prompt = [3, 17, 99, 5, 250, 42]
    assert greedy_with_logits(model, prompt, 20) == hf_greedy(hf_model, prompt, 20)


@pytest.mark.parametrize("parallel", [
    ParallelConfig(tp=2), ParallelConfig(tp=4), ParallelConfig(tp=8),
    ParallelConfig(spp=2, tp=2), ParallelConfig(kvp=2, tp=4), ParallelConfig(dp=2, cp=2, tp=2),
], ids=str)
def test_every_mesh_shape_gives_the_one_device_logits(tmp_path_factory, parallel):
    path = tmp_path_factory.getbasetemp() / "mesh-oracle"
    if not path.exists():
        save_tiny_llama(path, "gqa4-llama3-rope")
    ids = np.random.default_rng(2).integers(0, 256, size=40).tolist()
    single = load_model(path).logits(ids)
    sharded_model = load_model(path, parallel=parallel)
    assert sharded_model.parallel == parallel
    np.testing.assert_allclose(sharded_model.logits(ids), single, atol=2e-5, rtol=0)


def test_any_chunking_gives_the_one_shot_logits():
    model = load_model("tiny", verbose=False)
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 256, size=70).tolist()
    one_shot = model.logits(ids)
    for chunks in ([1] * 5 + [65], [33, 1, 1, 35], [16, 16, 16, 16, 6]):
        np.testing.assert_allclose(model.logits(ids, chunk_sizes=chunks), one_shot,
                                   atol=2e-5, rtol=0, err_msg=str(chunks))
    with pytest.raises(ValueError, match="must be positive and sum to 70"):
        model.logits(ids, chunk_sizes=[10, 10])


@pytest.fixture(scope="module")
def odd_vocab_checkpoint(tmp_path_factory):
    """A vocabulary no tp divides (257, like 32001 or 50257 in real checkpoints)."""
    path = tmp_path_factory.mktemp("odd-vocab")
    return path, save_tiny_llama(path, "gqa4-llama3-rope", vocab_size=257)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocabulary_that_no_tp_divides_matches_transformers(odd_vocab_checkpoint, tp):
    path, hf_model = odd_vocab_checkpoint
    model = load_model(path, parallel=ParallelConfig(tp=tp), verbose=False)
    assert model.layout.padded_vocab_size == -(-257 // tp) * tp
    ids = np.random.default_rng(3).integers(0, 257, size=33).tolist()
    ours = model.logits(ids)
    assert ours.shape == (33, 257)                       # exactly vocab_size columns
    np.testing.assert_array_less(np.abs(ours - hf_logits(hf_model, ids)).max(), 1e-4)
    prompt = [3, 256, 99, 5]
    assert greedy_with_logits(model, prompt, 8) == hf_greedy(hf_model, prompt, 8)


def test_dtype_defaults_to_float32_on_the_cpu_and_is_said(odd_vocab_checkpoint, capsys):
    from medha_jax.model.loading import default_dtype

    assert default_dtype("bfloat16", "cpu") == "float32"
    assert default_dtype("bfloat16", "gpu") == default_dtype("bfloat16", "tpu") == "bfloat16"
    path, _ = odd_vocab_checkpoint
    assert load_model(path).config.dtype == "float32"
    assert "in float32" in capsys.readouterr().err
    model = load_model(path, dtype="bfloat16")
    assert model.config.dtype == "bfloat16"
    assert model.module.embed[...].dtype == np.dtype("bfloat16")
    assert "bfloat16 (as asked)" in capsys.readouterr().err


def test_checkpoint_errors_name_the_tensor_or_field(tmp_path):
    from medha_jax.checkpoint import CheckpointError

    save_tiny_llama(tmp_path, "gqa4-llama3-rope")
    config = json.loads((tmp_path / "config.json").read_text())

    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 4.0}
    config.pop("rope_parameters", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="dynamic"):
        load_model(tmp_path)

    config["rope_scaling"] = None
    config["num_attention_heads"] = 4     # q_proj no longer matches heads * head_dim
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="q_proj|wq"):
        load_model(tmp_path)


def test_unknown_model_and_indivisible_mesh_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="dimension heads=9 is not divisible by tp=2"):
        load_model("smollm2-135m", parallel=ParallelConfig(tp=2))


@pytest.mark.slow
def test_smollm2_from_gguf_greedy_matches_transformers():
    import transformers

    from medha_jax.checkpoint import default_model_path

    gguf_path = default_model_path()
    model = load_model("smollm2-135m")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, torch_dtype="float32").eval()
    prompt = model.tokenizer.encode("The capital of France is")
    np.testing.assert_array_less(
        np.abs(model.logits(prompt) - hf_logits(hf_model, prompt)).max(), 1e-3)
    assert greedy_with_logits(model, prompt, 20) == hf_greedy(hf_model, prompt, 20)
