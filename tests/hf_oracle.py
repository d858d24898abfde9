"""The Hugging Face oracle: tiny random LlamaForCausalLM checkpoints and greedy decoding.

Imported only by tests marked `hf` (torch and transformers are test dependencies).
"""

from __future__ import annotations

import numpy as np

# Two shapes the issue asks for: GQA ratio 4 with llama3 rope scaling, and tied embeddings.
TINY_HF_CONFIGS = {
    "gqa4-llama3-rope": dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-5,
        rope_theta=10_000.0, max_position_embeddings=2048, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "tied-embeddings": dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, intermediate_size=96, rms_norm_eps=1e-6,
        rope_theta=10_000.0, max_position_embeddings=2048, tie_word_embeddings=True),
}


def save_tiny_llama(path, name: str, *, seed: int = 0, max_shard_size: str = "100KB",
                    **overrides):
    """Saves a random-weight float32 LlamaForCausalLM to `path` (sharded safetensors);
    `overrides` change fields of the named config (vocab_size=257, ...)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**TINY_HF_CONFIGS[name], **overrides})
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True, max_shard_size=max_shard_size)
    return model


# One tiny random checkpoint per family beside Llama (transformers class, config), each
# with its difference from the Llama block (config.FAMILIES) exercised.
TINY_FAMILY_CONFIGS = {
    # Qwen2.5-0.5B's shape in miniature: q/k/v biases, tied embeddings, theta 1e6.
    "qwen2": ("Qwen2", dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        max_position_embeddings=2048, tie_word_embeddings=True)),
    # Qwen2.5's long-context configs: YaRN (head_dim 32 so the ramp spans several dims).
    "qwen2-yarn": ("Qwen2", dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=128, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                         "original_max_position_embeddings": 256},
        max_position_embeddings=1024, tie_word_embeddings=False)),
    # Qwen3: q/k norms, head_dim 32 though hidden / heads is 16.
    "qwen3": ("Qwen3", dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=128, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        max_position_embeddings=2048, tie_word_embeddings=False)),
    # Mistral: a sliding window shorter than the tests' prompts, and Mistral-Nemo's
    # explicit head_dim (32, not hidden / heads = 16).
    "mistral": ("Mistral", dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=128, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        max_position_embeddings=2048, sliding_window=24, tie_word_embeddings=False)),
    # Gemma-3: sliding layers (window 24, RoPE base 1e4) around a full one (base 1e6, linear
    # scaling as on 4B and up), (1 + w) q/k and sandwich norms, GeGLU, the scaled tied
    # embedding, query_pre_attn_scalar unlike head_dim, and a final soft-cap that bites.
    "gemma3": ("Gemma3Text", dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=128, rms_norm_eps=1e-6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=24, query_pre_attn_scalar=24, final_logit_softcapping=5.0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        max_position_embeddings=2048, tie_word_embeddings=True)),
}


def save_tiny_family(path, name: str, *, seed: int = 0, **overrides):
    """Saves a random-weight float32 model of TINY_FAMILY_CONFIGS[name] to `path`, its norms
    and biases random too (transformers starts them at ones and zeros, which would hide a
    weight read wrongly)."""
    import torch
    import transformers

    prefix, fields = TINY_FAMILY_CONFIGS[name]
    torch.manual_seed(seed)
    config = getattr(transformers, prefix + "Config")(**{**fields, **overrides})
    model = getattr(transformers, prefix.removesuffix("Text") + "ForCausalLM")(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight") or param_name.endswith(".bias"):
                param.normal_()
    model.save_pretrained(path, safe_serialization=True)
    return model


# A tiny SigLIP vision tower beside the text model: a Gemma3ForConditionalGeneration
# checkpoint holds its weights, which the text-only loader must leave out.
TINY_VISION_CONFIG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, image_size=28, patch_size=14)


def save_tiny_gemma3_multimodal(path, *, seed: int = 0, **text_overrides):
    """Saves a random-weight float32 Gemma3ForConditionalGeneration (Gemma-3 4B and up) to
    `path`: TINY_FAMILY_CONFIGS' gemma3 text model (its norms random) and a tiny vision
    tower. No final soft-cap: transformers' multimodal model does not apply one (the
    releases set none), so the loader refuses it."""
    import torch
    import transformers

    text = {**TINY_FAMILY_CONFIGS["gemma3"][1], "final_logit_softcapping": None,
            **text_overrides}
    config = transformers.Gemma3Config(text_config=text, vision_config=TINY_VISION_CONFIG,
                                       mm_tokens_per_image=4, boi_token_index=253,
                                       eoi_token_index=254, image_token_index=255)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.normal_()
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_logits(hf_model, token_ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor([list(token_ids)])).logits[0].float().numpy()


def hf_greedy(hf_model, token_ids, max_new_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = hf_model.generate(torch.tensor([list(token_ids)]), max_new_tokens=max_new_tokens,
                                do_sample=False, min_new_tokens=max_new_tokens,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(token_ids):].tolist()


def greedy_with_logits(model, token_ids, max_new_tokens: int) -> list[int]:
    """Greedy decoding through our one-shot `Model.logits` (no KV reuse; the oracle path)."""
    ids = list(token_ids)
    for _ in range(max_new_tokens):
        ids.append(int(np.argmax(model.logits(ids)[-1])))
    return ids[len(token_ids):]
