"""The Llama-3 family model: the parameter table and mesh layout, layers, the NNX module,
attention, and loading."""

from medha_jax.model.attention import AttentionMetadata
from medha_jax.model.llama import KVCache, Llama
from medha_jax.model.loading import DEFAULT_MODEL, Model, load_model
from medha_jax.model.params import KV_CACHE_AXES, MeshLayout, ParamSpec, param_specs

__all__ = ["DEFAULT_MODEL", "KV_CACHE_AXES", "AttentionMetadata", "KVCache", "Llama", "MeshLayout",
           "Model", "ParamSpec", "load_model", "param_specs"]
