import pytest

from medha_jax.config import MODEL_PRESETS, ModelConfig, RopeScaling, model_preset


def test_presets_have_the_published_sizes():
    assert abs(model_preset("llama3-8b").num_params() / 1e9 - 8.03) < 0.01
    assert abs(model_preset("llama3-70b").num_params() / 1e9 - 70.55) < 0.05
    assert abs(model_preset("smollm2-135m").num_params() / 1e6 - 134.5) < 0.5
    assert model_preset("llama3.1-8b").rope_scaling == RopeScaling()
    # 128 KiB of K+V per token for Llama-3 8B in bf16.
    assert model_preset("llama3-8b").kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2


def test_config_validation_names_the_field():
    base = dict(vocab_size=8, hidden_size=8, num_layers=1, num_heads=4, num_kv_heads=2,
                head_dim=2, intermediate_size=8)
    ModelConfig(**base)
    with pytest.raises(ValueError, match="num_heads=4 must be a multiple of num_kv_heads=3"):
        ModelConfig(**{**base, "num_kv_heads": 3})
    with pytest.raises(ValueError, match="ModelConfig.hidden_size must be a positive int"):
        ModelConfig(**{**base, "hidden_size": 0})
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(**{**base, "dtype": "int8"})
    with pytest.raises(ValueError, match="high_freq_factor > low_freq_factor"):
        RopeScaling(low_freq_factor=4.0, high_freq_factor=1.0)
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        model_preset("nope")
    assert "tiny" in MODEL_PRESETS


def test_configs_and_the_scheduler_import_without_jax():
    import subprocess
    import sys

    code = ("import sys, medha_jax, medha_jax.scheduler, meshes; "
            "print('jax' in sys.modules, meshes.ParallelConfig(tp=2).tp)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "2"]
