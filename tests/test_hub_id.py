"""Models by Hugging Face Hub id: resolved through the local Hugging Face cache (a cache laid
out here as huggingface_hub writes it), and a clear error naming the id when it is absent
and the hub is offline."""

import json

import numpy as np
import pytest

from medha_jax import load_model
from medha_jax.config import model_preset
from tests.test_checkpoint_hf import hf_config_dict, random_state_dict, write_hf_dir
from tests.test_server import byte_level_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


def cache_checkpoint(cache, repo_id):
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    config = model_preset("tiny")
    snapshot = write_hf_dir(repo / "snapshots" / COMMIT, hf_config_dict(config),
                            random_state_dict(config, seed=3))
    byte_level_tokenizer().backend.save(str(snapshot / "tokenizer.json"))
    (snapshot / "tokenizer_config.json").write_text(json.dumps({}))
    return snapshot


def test_hub_id_loads_from_the_cache(hub_cache):
    snapshot = cache_checkpoint(hub_cache, "medha-test/tiny-llama")
    by_id = load_model("medha-test/tiny-llama", verbose=False)
    by_dir = load_model(str(snapshot), verbose=False)
    ids = by_dir.tokenizer.encode("hello")
    np.testing.assert_array_equal(by_id.logits(ids), by_dir.logits(ids))
    assert by_id.tokenizer is not None
    # A revision that is a cached commit works too.
    assert load_model(f"medha-test/tiny-llama@{COMMIT}", verbose=False).config == by_id.config


def test_absent_hub_id_offline_is_named(hub_cache):
    with pytest.raises(ValueError, match=r"model 'medha-test/absent' is not in the Hugging "
                                         r"Face cache and HF_HUB_OFFLINE is set"):
        load_model("medha-test/absent", verbose=False)


def test_not_an_id_is_an_unknown_model(hub_cache):
    with pytest.raises(ValueError, match="unknown model 'a/b/c'"):
        load_model("a/b/c", verbose=False)
