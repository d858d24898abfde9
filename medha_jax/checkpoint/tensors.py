"""Checkpoint tensors as lazy, sliceable sources in one canonical layout.

Every checkpoint format (Hugging Face safetensors, GGUF) stores a Llama decoder as
per-layer matrices in PyTorch's `nn.Linear` orientation, `W: [out, in]`. The engine wants
the weights stacked over layers, in "x @ W" orientation, with attention heads split out:

    "embed"          [V, D]           "final_norm"     [D]
    "lm_head"        [D, V]           (absent when config.tie_word_embeddings)
    "layers.attn_norm" [L, D]         "layers.mlp_norm" [L, D]
    "layers.wq"      [L, D, H, hd]    "layers.wk", "layers.wv"  [L, D, K, hd]
    "layers.wo"      [L, H, hd, D]
    "layers.w_gate", "layers.w_up"    [L, D, F]
    "layers.w_down"  [L, F, D]

A `TensorSource` reads any rectangular slice of a canonical tensor on demand, so a loader
can build each device's shard with `jax.make_array_from_callback(src.shape, sharding,
src.read)` without materializing the whole model anywhere. A format module supplies only
its stored tensors (`StoredTensor`: shape + a reader of contiguous slices) and their names;
`canonical_tensors` checks names and shapes and composes the layout changes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

from typing import TYPE_CHECKING

import numpy as np

from medha_jax.config import ModelConfig

if TYPE_CHECKING:
    from medha_jax.model.params import ParamSpec
    from medha_jax.checkpoint.tokenizer import Tokenizer

# A reader of contiguous, in-bounds slices (step 1, one per dimension) -> float32 array.
Reader = Callable[[tuple[slice, ...]], np.ndarray]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the tensor or field."""


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """One canonical tensor, read lazily.

    `read(index)` takes one slice per dimension (as `jax.make_array_from_callback` passes
    them; fewer slices mean the trailing dimensions in full) and returns that part of the
    tensor as a float32 numpy array, touching only the stored data it needs.
    """

    shape: tuple[int, ...]
    read: Callable[[tuple[slice, ...]], np.ndarray]

    def read_all(self) -> np.ndarray:
        return self.read(tuple(slice(None) for _ in self.shape))


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """A tensor as a checkpoint file stores it (`[out, in]` for matrices), read lazily."""

    shape: tuple[int, ...]
    read: Reader


def lazy_source(shape: tuple[int, ...], read_contiguous: Reader) -> TensorSource:
    """A TensorSource over `read_contiguous`, accepting any slices (None bounds, steps).

    Each slice is widened to the contiguous range it spans, read once, and the step is
    applied afterwards; an empty slice returns an empty array without reading.
    """
    shape = tuple(int(n) for n in shape)

    def read(index: tuple[slice, ...]) -> np.ndarray:
        index = tuple(index)
        if len(index) > len(shape) or not all(isinstance(s, slice) for s in index):
            raise IndexError(f"{index=} must be at most {len(shape)} slices for {shape=}")
        index += (slice(None),) * (len(shape) - len(index))
        spans = [range(*s.indices(n)) for s, n in zip(index, shape)]
        if any(len(span) == 0 for span in spans):
            return np.zeros([len(span) for span in spans], np.float32)
        bounds = tuple(slice(min(span), max(span) + 1) for span in spans)
        out = np.asarray(read_contiguous(bounds), dtype=np.float32)
        expected = tuple(b.stop - b.start for b in bounds)
        if out.shape != expected:
            raise AssertionError(f"reader returned {out.shape} for {bounds=}, expected {expected}")
        for axis, (span, bound) in enumerate(zip(spans, bounds)):
            if span.step != 1:
                out = np.take(out, np.asarray(span) - bound.start, axis=axis)
        return out

    return TensorSource(shape, read)


# --- Layout changes from one stored layer to its canonical per-layer view. ---------------

def transposed(matrix: Reader) -> Reader:
    """[in, out] from a stored [out, in] matrix."""
    return lambda idx: matrix((idx[1], idx[0])).T


def split_out_heads(matrix: Reader, head_dim: int, rope_interleaved: bool = False) -> Reader:
    """[in, heads, head_dim] from a stored [heads * head_dim, in] matrix (wq, wk, wv).

    Reads only the requested heads. `rope_interleaved`: the rows of each head are in the
    order llama.cpp's convert_hf_to_gguf writes Q and K (rotary pairs (2j, 2j+1) side by
    side); reorder them to Hugging Face's rotate_half layout, where dims j and j + hd/2 pair.
    """
    def read(idx: tuple[slice, ...]) -> np.ndarray:
        cols_in, heads, dims = idx
        rows = matrix((slice(heads.start * head_dim, heads.stop * head_dim), cols_in))
        per_head = rows.reshape(heads.stop - heads.start, head_dim, -1)   # [h, hd, in]
        if rope_interleaved:
            per_head = (per_head.reshape(per_head.shape[0], head_dim // 2, 2, -1)
                        .swapaxes(1, 2).reshape(per_head.shape))
        return per_head[:, dims, :].transpose(2, 0, 1)                   # [in, h, hd]
    return read


def merge_in_heads(matrix: Reader, head_dim: int) -> Reader:
    """[heads, head_dim, out] from a stored [out, heads * head_dim] matrix (wo)."""
    def read(idx: tuple[slice, ...]) -> np.ndarray:
        heads, dims, cols_out = idx
        cols = matrix((cols_out, slice(heads.start * head_dim, heads.stop * head_dim)))
        per_head = cols.T.reshape(heads.stop - heads.start, head_dim, -1)  # [h, hd, out]
        return per_head[:, dims, :]
    return read


def split_bias_heads(vector: Reader, head_dim: int, rope_interleaved: bool = False) -> Reader:
    """[heads, head_dim] from a stored [heads * head_dim] bias (bq, bk, bv); rope_interleaved
    as in `split_out_heads`."""
    def read(idx: tuple[slice, ...]) -> np.ndarray:
        heads, dims = idx
        per_head = vector((slice(heads.start * head_dim, heads.stop * head_dim),))
        per_head = per_head.reshape(heads.stop - heads.start, head_dim)
        if rope_interleaved:
            per_head = (per_head.reshape(-1, head_dim // 2, 2).swapaxes(1, 2)
                        .reshape(per_head.shape))
        return per_head[:, dims]
    return read


def stacked(layer: Callable[[int], Reader]) -> Reader:
    """[L, ...] from per-layer readers; reads only the layers in idx[0]."""
    def read(idx: tuple[slice, ...]) -> np.ndarray:
        return np.stack([layer(i)(idx[1:]) for i in range(idx[0].start, idx[0].stop)])
    return read


# --- The canonical set: the model's parameter table (medha_jax.model.params). ------------

def _stored_shape(spec: ParamSpec, head_dim: int) -> tuple[int, ...]:
    """The shape a checkpoint stores one layer's (or a global) tensor in."""
    shape = spec.shape[1:] if spec.per_layer else spec.shape
    if spec.stored_layout == "linear":
        return shape[::-1]                                   # [in, out] -> [out, in]
    if spec.stored_layout in ("qk_heads", "v_heads"):
        d_in, heads, _ = shape
        return (heads * head_dim, d_in)
    if spec.stored_layout == "o_heads":
        heads, _, d_out = shape
        return (d_out, heads * head_dim)
    if spec.stored_layout in ("qk_bias", "v_bias"):
        heads, _ = shape
        return (heads * head_dim,)
    return shape


def _canonical_reader(spec: ParamSpec, read: Reader, head_dim: int,
                      rope_interleaved_qk: bool) -> Reader:
    if spec.stored_layout == "linear":
        return transposed(read)
    if spec.stored_layout == "qk_heads":
        return split_out_heads(read, head_dim, rope_interleaved_qk)
    if spec.stored_layout == "v_heads":
        return split_out_heads(read, head_dim)
    if spec.stored_layout == "o_heads":
        return merge_in_heads(read, head_dim)
    if spec.stored_layout == "qk_bias":
        return split_bias_heads(read, head_dim, rope_interleaved_qk)
    if spec.stored_layout == "v_bias":
        return split_bias_heads(read, head_dim)
    return read


def canonical_tensors(
    config: ModelConfig,
    stored: Mapping[str, StoredTensor],
    checkpoint_format: str,
    *,
    ignored: Callable[[str], bool] = lambda name: False,
    rope_interleaved_qk: bool = False,
) -> dict[str, TensorSource]:
    """Checks a checkpoint's stored tensors against `config` and maps them to canonical ones.

    checkpoint_format: "hf" or "gguf", which names of the parameter table to look for
      (per-layer names contain "{layer}"). ignored(name): stored tensors that may be present
      and are not weights (e.g. a tied checkpoint's duplicate lm_head); any other unknown
      tensor is an error, since silently dropping one (an attention bias, say) would give a
      wrong model.
    rope_interleaved_qk: Q and K rows are in llama.cpp's interleaved-rope order.
    """
    from medha_jax.model.params import param_specs

    specs = param_specs(config)
    head_dim = config.head_dim
    expected: dict[str, tuple[str, tuple[int, ...]]] = {}   # stored name -> (canonical, shape)
    for key, spec in specs.items():
        name = spec.checkpoint_name(checkpoint_format)
        shape = _stored_shape(spec, head_dim)
        layers = range(config.num_layers) if spec.per_layer else [None]
        for layer in layers:
            expected[name.format(layer=layer)] = (key, shape)

    for stored_name, (canonical, shape) in expected.items():
        if stored_name not in stored:
            raise CheckpointError(f"missing tensor {stored_name!r} (canonical {canonical!r})")
        if stored[stored_name].shape != shape:
            raise CheckpointError(
                f"tensor {stored_name!r} has shape {stored[stored_name].shape}, expected {shape} "
                f"for {canonical!r} of {config.name!r}")
    unknown = sorted(n for n in stored if n not in expected and not ignored(n))
    if unknown:
        raise CheckpointError(
            f"unexpected tensors {unknown[:5]}{' ...' if len(unknown) > 5 else ''}: not weights "
            f"of a {config.family} decoder with this config")

    tensors = {}
    for key, spec in specs.items():
        name = spec.checkpoint_name(checkpoint_format)
        wrap = functools.partial(_canonical_reader, spec, head_dim=head_dim,
                                 rope_interleaved_qk=rope_interleaved_qk)
        if spec.per_layer:
            read = stacked(lambda i, name=name, wrap=wrap: wrap(stored[name.format(layer=i)].read))
        else:
            read = wrap(stored[name].read)
        tensors[key] = lazy_source(spec.shape, read)
    return tensors


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A model checkpoint: its shape, its canonical tensors (lazy) and its tokenizer."""

    config: ModelConfig
    tensors: dict[str, TensorSource]
    tokenizer: Tokenizer | None
