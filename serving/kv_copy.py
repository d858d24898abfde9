"""Copying KV pages between two replicas' caches in one process (the device side of the
hand-off, serving.kv_transfer).

A replica's cache is `KVCache` [layers, pages, page_size, kv_heads * head_dim] on its own
mesh. `gather_pages` reads some pages of the source cache into a chunk
[layers, n, page_size, kv_heads * head_dim]; `jax.device_put` moves it to the destination
mesh (asynchronous: it overlaps with the steps both replicas dispatch next);
`scatter_pages` writes it into the destination's pages. The page count is padded up to a
power of two (padding ids point one past the cache, read as zeros and dropped on write),
so a few shapes compile once.

What can be copied: the same model, page_size and dtype on both sides, one program per
replica (spp = 1, cp = 1); kvp and tp may differ as long as the cache's folded head axis
has the same global size (tp <= kv_heads on both sides: tp beyond the K/V heads repeats
them, a different layout).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from medha_jax.model import KVCache


def padded_count(n: int) -> int:
    """Pages per copy, padded to a power of two, at least 2: XLA rewrites a one-page
    scatter as a dynamic-update-slice guarded by a select (the drop of an out-of-range
    id), which cannot update in place and copies the whole cache."""
    return 1 << max(n - 1, 1).bit_length()


def padded_ids(page_ids: np.ndarray, num_pages: int) -> np.ndarray:
    """int32 [padded_count(n)]: the ids, then `num_pages` (out of range) as padding."""
    out = np.full(padded_count(len(page_ids)), num_pages, np.int32)
    out[:len(page_ids)] = page_ids
    return out


@jax.jit
def gather_pages(cache: KVCache, page_ids: jax.Array) -> KVCache:
    """cache [L, P, ps, F], page_ids int32 [n] -> [L, n, ps, F] (out-of-range ids: zeros)."""
    take = lambda a: jnp.take(a, page_ids, axis=1, mode="fill", fill_value=0)  # noqa: E731
    return KVCache(k=take(cache.k), v=take(cache.v))


def _scatter(cache: KVCache, page_ids: jax.Array, chunk: KVCache) -> KVCache:
    put = lambda a, x: a.at[:, page_ids].set(x, mode="drop")  # noqa: E731
    return KVCache(k=put(cache.k, chunk.k), v=put(cache.v, chunk.v))


def page_scatter(engine):
    """The jitted write of a chunk into `engine`'s cache (donated, its sharding kept):
    one per destination engine, shared by every source's PageCopier."""
    shardings = jax.tree.map(lambda a: a.sharding, engine.kv_cache)
    return jax.jit(_scatter, donate_argnums=0, out_shardings=shardings)


def warm_up(engine, scatter, max_pages: int) -> int:
    """Compiles the gather and the scatter of every padded page count up to max_pages on
    `engine`'s cache, by copies that read nothing and write nothing (every id out of
    range), so no hand-off waits for a compile. Only while no step of the engine runs.
    Returns the shapes compiled."""
    cache = engine.kv_cache
    mesh = cache.k.sharding.mesh
    n, count = padded_count(1), 0
    while True:
        ids = jax.device_put(np.full(n, cache.num_pages, np.int32),
                             NamedSharding(mesh, PartitionSpec()))
        chunk = gather_pages(cache, ids)
        chunk = jax.device_put(chunk, _chunk_sharding(cache.k.sharding))
        cache = scatter(cache, ids, chunk)
        count += 1
        if n >= max_pages:
            break
        n *= 2
    engine.kv_cache = jax.block_until_ready(cache)
    return count


def _chunk_sharding(cache_sharding) -> NamedSharding:
    # The chunk's pages are not split like the cache's page axis (kvp): replicated there.
    spec = tuple(cache_sharding.spec) + (None,) * (4 - len(cache_sharding.spec))
    return NamedSharding(cache_sharding.mesh, PartitionSpec(spec[0], None, spec[2], spec[3]))


def check_copyable(name: str, engine) -> None:
    """Raises unless `engine`'s cache is one program's, unsplit by ring ranks (what a
    hand-off copies)."""
    if engine.kv_cache is None:
        raise ValueError(f"the {name} replica runs spp > 1 stages: its KV cache is "
                         "split over stage programs, which the hand-off does not copy")
    if engine.cp_ranks > 1:
        raise ValueError(f"the {name} replica runs cp={engine.cp_ranks}: its pages are "
                         "split over ring ranks, which the hand-off does not copy")


def check_same_layout(source: tuple, destination: tuple) -> None:
    """source, destination: (shape, dtype) of two caches' K ([L, P, ps, F]); raises unless
    their pages can be exchanged."""
    (src_shape, src_dtype), (dst_shape, dst_dtype) = source, destination
    if (src_shape[0], src_shape[2], src_shape[3], str(src_dtype)) != \
            (dst_shape[0], dst_shape[2], dst_shape[3], str(dst_dtype)):
        raise ValueError(f"KV caches of different layouts cannot exchange pages: "
                         f"{tuple(src_shape)} {src_dtype} vs {tuple(dst_shape)} {dst_dtype} "
                         "(layers, page_size, folded K/V heads and dtype must match)")


def read_pages(engine, page_ids: np.ndarray) -> KVCache:
    """The pages (global ids) of `engine`'s cache gathered on its devices, padded to
    `padded_count` pages (not waited for). On the engine's loop thread."""
    cache = engine.kv_cache
    ids = jax.device_put(padded_ids(page_ids, cache.num_pages),
                         NamedSharding(cache.k.sharding.mesh, PartitionSpec()))
    return gather_pages(cache, ids)


class PageWriter:
    """The destination's half of a copy: writes chunks of pages into one engine's cache,
    on its loop thread (which owns the cache)."""

    def __init__(self, destination, scatter=None):
        """scatter: `page_scatter(destination)` to share (made here when None)."""
        check_copyable("destination", destination)
        self.destination = destination
        sharding = destination.kv_cache.k.sharding
        self.chunk_sharding = _chunk_sharding(sharding)
        self._ids_sharding = NamedSharding(sharding.mesh, PartitionSpec())
        self._scatter = scatter or page_scatter(destination)

    def write(self, page_ids: np.ndarray, chunk: KVCache) -> None:
        """Writes the chunk's first len(page_ids) pages into those pages (global ids)."""
        engine = self.destination
        ids = padded_ids(page_ids, engine.kv_cache.num_pages)
        if len(ids) != chunk.k.shape[1]:
            raise ValueError(f"{len(page_ids)} destination pages for a chunk of "
                             f"{chunk.k.shape[1]} padded pages")
        engine.kv_cache = self._scatter(engine.kv_cache,
                                        jax.device_put(ids, self._ids_sharding), chunk)


class PageCopier:
    """Copies pages from one engine's cache into another's in this process. One per
    (source, destination) pair of engines; the caller runs `read` on the source's loop
    thread and `write` on the destination's (each thread owns its engine's cache)."""

    def __init__(self, source, destination, scatter=None):
        """scatter: `page_scatter(destination)` to share (made here when None)."""
        check_copyable("source", source)
        self.writer = PageWriter(destination, scatter)
        src, dst = source.kv_cache.k, destination.kv_cache.k
        check_same_layout((src.shape, src.dtype), (dst.shape, dst.dtype))
        self.source, self.destination = source, destination

    def read(self, page_ids: np.ndarray) -> KVCache:
        """Source loop thread: starts copying the pages (global ids) to the destination's
        devices; returns the chunk there (not waited for)."""
        return jax.device_put(read_pages(self.source, page_ids), self.writer.chunk_sharding)

    def write(self, page_ids: np.ndarray, chunk: KVCache) -> None:
        """Destination loop thread: writes the chunk's first len(page_ids) pages into those
        pages (global ids) of its cache."""
        self.writer.write(page_ids, chunk)


@functools.cache
def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """K and V of every layer of one token: what a hand-off moves per token."""
    return 2 * num_layers * kv_heads * head_dim * itemsize
