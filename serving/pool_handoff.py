"""A prompt prefilled by the CDSP pool (medha_jax.engine.cdsp_pool) handed to a decode
replica: the decode side of `serving.kv_transfer`'s handshake, from a pool whose K/V are
split by token over a ring group to a replica whose pages split K/V heads over its tp.

    1. the decode replica reserves the prompt's full pages (pages it has cached are reused,
       not moved); a replica that cannot reserve them now says so (MemoryError)
    2. the pool gathers each rank's tokens of the rest; `jax.device_put` moves them to the
       decode mesh (K/V heads split as its pages split them); one program there places
       them by position into whole pages, which are written into the reservation
    3. the pages are registered in the replica's prefix cache under the prompt's page
       hashes (seed 003 H6) and stay pinned by the reservation
    4. the request runs there from prompt + first token (the pool's) and takes them by
       prefix reuse, computing only the prompt's last partial page; the caller then frees
       the reservation (the pages stay cached)

Runs on the decode replica's loop thread, which owns its cache and allocator
(`ServingLoop.call`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from medha_jax.model import KVCache
from serving.kv_copy import PageWriter, check_same_layout, padded_count
from serving.kv_transfer import global_pages, reservation_id


def hand_off(pool, sequence_id: str, engine, request_id: str) -> tuple[str, int]:
    """Steps 1-3 for `pool`'s prefilled `sequence_id` into `engine` (the decode replica's,
    on its loop thread). Returns (the reservation id, pages moved); free the reservation
    (`engine.allocator.free`) once the request holds its pages."""
    allocator, ps = engine.allocator, pool.page_size
    if allocator.page_size != ps:
        raise ValueError(f"the decode replica's pages hold {allocator.page_size} tokens, the "
                         f"pool's {ps}")
    check_same_layout(pool.kv_layout, (engine.kv_cache.k.shape, engine.kv_cache.k.dtype))
    tokens = pool.token_ids(sequence_id).tolist()
    full = len(tokens) // ps
    res_id = reservation_id(request_id, 0)
    reused = allocator.allocate(res_id, tokens[:full * ps + 1])
    if not allocator.reserve(res_id, full * ps):
        allocator.free(res_id)
        raise MemoryError(f"the decode replica cannot reserve {full} pages now")
    low = reused // ps
    ids = global_pages(allocator, res_id)[low:full]
    if len(ids):
        writer = PageWriter(engine)
        kv, where = pool.prompt_kv(sequence_id, low * ps, full * ps)
        kv = jax.device_put(kv, _gathered_sharding(writer.chunk_sharding))
        writer.write(ids, _by_position(kv, where, num_pages=padded_count(len(ids)),
                                       page_size=ps, out=writer.chunk_sharding))
    allocator.commit(res_id, tokens, full * ps)
    return res_id, len(ids)


def _gathered_sharding(chunk_sharding: NamedSharding) -> NamedSharding:
    """Of the gathered [2, layers, tokens, F] on the decode mesh: F (the K/V heads) split
    as the replica's page chunks split it, the rest whole."""
    spec = tuple(chunk_sharding.spec) + (None,) * (4 - len(chunk_sharding.spec))
    return NamedSharding(chunk_sharding.mesh, PartitionSpec(None, spec[0], None, spec[3]))


@functools.partial(jax.jit, static_argnames=("num_pages", "page_size", "out"))
def _by_position(kv, where, *, num_pages: int, page_size: int, out: NamedSharding) -> KVCache:
    """kv [2, layers, n, F] of tokens at offsets `where` [n] (-1: padding) -> the pages
    [layers, num_pages, page_size, F] they fill, K and V, in the replica's chunk sharding
    `out` (what `serving.kv_copy.PageWriter` writes)."""
    _, layers, _, features = kv.shape
    index = jnp.where(where < 0, num_pages * page_size, where)
    pages = jnp.zeros((2, layers, num_pages * page_size, features), kv.dtype)
    pages = pages.at[:, :, index].set(kv, mode="drop")
    pages = pages.reshape(2, layers, num_pages, page_size, features)
    constrain = lambda a: jax.lax.with_sharding_constraint(a, out)  # noqa: E731
    return KVCache(k=constrain(pages[0]), v=constrain(pages[1]))
