"""A prompt prefilled by the CDSP pool (medha_jax.engine.cdsp_pool) handed to a decode
replica: the decode side of `serving.kv_transfer`'s handshake, from a pool whose K/V are
split by token over a ring group to a replica whose pages split K/V heads over its tp.

    1. the pool gathers each rank's tokens of the prompt's full pages (`gather_prompt`, on
       the thread that drives the pool)
    2. the decode replica reserves those pages (pages it has cached are reused, not
       written; one that cannot reserve them now says so: MemoryError);
       `jax.device_put` moves the gathered K/V to the decode mesh (K/V heads split as
       its pages split them); one program there places them by position into whole
       pages, which are written into the reservation (`place_prompt`)
    3. the pages are registered in the replica's prefix cache under the prompt's page
       hashes (seed 003 H6) and stay pinned by the reservation
    4. the request runs there and takes them (by prefix reuse, or handed the reservation
       itself: `ReplicaController.add_request(kv_from=)`), computing only what follows
       the full pages; a reservation taken by prefix reuse is then freed (the pages stay
       cached)

Steps 2-3 run on the decode replica's loop thread, which owns its cache and allocator
(`ServingLoop.call`). `hand_off` is all of 1-3 on that thread, for a pool driven there;
`serving.prefill_pool` reserves (`reserve_prompt`, step 2's first half) before the pool
computes the pages, runs 1 on the pool's thread, and the rest on the decode replica's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from medha_jax.model import KVCache
from serving.kv_copy import PageWriter, check_same_layout, padded_count
from serving.kv_transfer import global_pages, reservation_id


@dataclasses.dataclass(frozen=True)
class PromptKV:
    """A pool sequence's full pages of K/V, gathered on the pool (step 2's first half).

    tokens: the sequence's token ids; kv: [2, layers, k * M, F] the group's ranks' tokens
    side by side (not waited for); where: int32 [k * M] each one's position, -1 padding;
    full_pages: the pages they fill; layout: (shape, dtype) of one pool device's K pages."""

    tokens: list[int]
    kv: jax.Array
    where: np.ndarray
    full_pages: int
    page_size: int
    layout: tuple


def gather_prompt(pool, sequence_id: str) -> PromptKV:
    """The pool's side of the hand-off, on the thread that drives the pool: every full
    page of a prefilled sequence gathered (dispatched, not waited for)."""
    tokens = pool.token_ids(sequence_id).tolist()
    full = len(tokens) // pool.page_size
    kv, where = pool.prompt_kv(sequence_id, 0, full * pool.page_size)
    return PromptKV(tokens, kv, where, full, pool.page_size, pool.kv_layout)


def reserve_prompt(engine, reservation: str, prompt_ids: Sequence[int],
                   full_pages: int) -> int:
    """The decode side's step 2 alone, the handshake, on its loop thread: reserves the
    first `full_pages` pages of `prompt_ids` under `reservation`, those it has cached by
    reuse. Returns the tokens reused; MemoryError, with nothing reserved, when it cannot
    now."""
    allocator, ps = engine.allocator, engine.allocator.page_size
    reused = allocator.allocate(reservation, list(prompt_ids[:full_pages * ps + 1]))
    if not allocator.reserve(reservation, full_pages * ps):
        allocator.free(reservation)
        raise MemoryError(f"the decode replica cannot reserve {full_pages} pages now")
    return reused


def place_prompt(prompt: PromptKV, engine, reservation: str,
                 prompt_ids: Sequence[int] | None = None, writer: PageWriter | None = None,
                 reused: int | None = None) -> int:
    """The decode side, steps 2-3, on the decode replica's loop thread: reserves the
    prompt's full pages under `reservation` (`reserve_prompt`; with `reused` given, the
    tokens it reused, the reservation was made before), writes the pages not reused from
    `prompt` and registers them in its prefix cache. prompt_ids: the request's prompt,
    when the pool held only its leading full pages (the prefix cache hashes by it).
    Returns the pages written; the caller frees the reservation once the request holds
    its pages (or hands it to the request: `ReplicaController.add_request(kv_from=)`).
    writer: the engine's PageWriter to reuse (its scatter compiled once), else a new one."""
    allocator, ps, full = engine.allocator, prompt.page_size, prompt.full_pages
    if allocator.page_size != ps:
        raise ValueError(f"the decode replica's pages hold {allocator.page_size} tokens, the "
                         f"pool's {ps}")
    check_same_layout(prompt.layout, (engine.kv_cache.k.shape, engine.kv_cache.k.dtype))
    tokens = list(prompt.tokens if prompt_ids is None else prompt_ids)
    if tokens[:full * ps] != prompt.tokens[:full * ps]:
        raise ValueError("prompt_ids do not begin with the pool sequence's full pages")
    if reused is None:
        reused = reserve_prompt(engine, reservation, tokens, full)
    low = reused // ps
    ids = global_pages(allocator, reservation)[low:full]
    if len(ids):
        writer = writer or PageWriter(engine)
        where = prompt.where - low * ps               # offsets in the pages written
        where = np.where(where < 0, -1, where).astype(np.int32)
        kv = jax.device_put(prompt.kv, _gathered_sharding(writer.chunk_sharding))
        writer.write(ids, _by_position(kv, where, num_pages=padded_count(len(ids)),
                                       page_size=ps, out=writer.chunk_sharding))
    allocator.commit(reservation, tokens, full * ps)
    return len(ids)


def hand_off(pool, sequence_id: str, engine, request_id: str) -> tuple[str, int]:
    """Steps 1-3 for `pool`'s prefilled `sequence_id` into `engine` (the decode replica's,
    on its loop thread, which then also drives the pool). Returns (the reservation id,
    pages moved); free the reservation (`engine.allocator.free`) once the request holds
    its pages."""
    reservation = reservation_id(request_id, 0)
    return reservation, place_prompt(gather_prompt(pool, sequence_id), engine, reservation)


def warm_up_placement(pool, engine, writer: PageWriter) -> int:
    """Compiles, on `engine`'s mesh, the placing (`_by_position`) of every gather the pool
    can hand over - each group size times page bucket of tokens per rank, into each padded
    count of pages it can fill - so that no hand-off waits for a compile. Runs each on
    zeros that fill nothing. Returns the shapes compiled."""
    from medha_jax.engine.cdsp_pool import aligned_groups

    (layers, _, ps, features), dtype = pool.kv_layout
    sharding = _gathered_sharding(writer.chunk_sharding)
    rank_pages = {size * bucket for _, size in aligned_groups(pool.num_devices)
                  for bucket in pool.page_buckets()}
    most = engine.allocator.num_pages
    count = 0
    for gathered in sorted(rank_pages):
        kv = jax.device_put(np.zeros((2, layers, gathered * ps, features), dtype), sharding)
        where = np.full(gathered * ps, -1, np.int32)
        pages = padded_count(1)
        while pages <= padded_count(min(gathered, most)):
            jax.block_until_ready(_by_position(kv, where, num_pages=pages, page_size=ps,
                                               out=writer.chunk_sharding))
            count += 1
            pages *= 2
    return count


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
