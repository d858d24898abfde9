"""The Llama-3 family model: layers, the NNX module, and loading."""

from medha_jax.model.llama import (KV_CACHE_AXES, PARAM_AXES, AttentionMetadata, KVCache, Llama,
                                   param_shapes)
from medha_jax.model.loading import DEFAULT_MODEL, Model, load_model

__all__ = ["DEFAULT_MODEL", "KV_CACHE_AXES", "PARAM_AXES", "AttentionMetadata", "KVCache", "Llama",
           "Model", "load_model", "param_shapes"]
