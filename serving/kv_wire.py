"""KV pages between processes: the hand-off's page copy when the prefill replica and the
decode replica live in different processes or hosts (serving.kv_copy is the in-process one).

    prefill process                                   decode process
    sender = PageSender(engine)                       receiver = PageReceiver(engine)
    wire = sender.send(page_ids)  --- WireChunk --->  receiver.receive(wire, page_ids)
           (gathers, offers for pulling)  (any channel:      (pulls, writes into its pages)
                                           Ray, a socket)

The bytes move with `jax.experimental.transfer` (measured on jaxlib 0.10.2: it works
between CPU processes, over its own TCP transport): the sender's transfer server holds the
gathered pages until the receiver pulls them by the chunk's id (on GPUs the library is
meant to copy device to device; not tried here, no GPU was lent). Only the small
`WireChunk` goes over the caller's channel.

Each side's chunk lives on one device of its replica (the sender gathers its pages there,
the receiver pulls them there and then spreads them over its own mesh), so the two
replicas may differ in tp and kvp as the in-process copy allows; what must match is the
cache's layout (layers, page_size, folded K/V heads, dtype), checked from the WireChunk.

A chunk that is never pulled (its receiver died) stays held by the sender's transfer
server: `jax.experimental.transfer` has no way to withdraw an offer, so a sender whose
peers die should be restarted with its replica (its chunks are a few MB each).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading

import jax
import numpy as np

from medha_jax.model import KVCache
from serving.kv_copy import PageWriter, check_copyable, check_same_layout, read_pages


@dataclasses.dataclass(frozen=True)
class WireChunk:
    """What the receiver needs to pull one chunk: where, which, and its shape.
    shape: [layers, padded pages, page_size, kv_heads * head_dim] of K (and of V)."""

    address: str
    uuid: int
    shape: tuple[int, int, int, int]
    dtype: str
    num_pages: int                    # real pages; the rest of shape[1] is padding

    @classmethod
    def from_dict(cls, fields: dict) -> WireChunk:
        """From `dataclasses.asdict` after a trip through JSON (the shape as a list)."""
        return cls(**{**fields, "shape": tuple(fields["shape"])})


def _transfer_server(engine, bind_host: str):
    from jax.experimental import transfer

    client = engine.model.mesh.devices.flat[0].client
    return transfer.start_transfer_server(client, f"{bind_host}:0", [f"{bind_host}:0"])


class PageSender:
    """The prefill side: offers chunks of its engine's pages for one receiver each to pull.
    `send` runs on the engine's loop thread (it reads the cache)."""

    def __init__(self, engine, *, bind_host: str = "127.0.0.1"):
        """bind_host: the address the receivers reach this process at (loopback here;
        the host's address on a cluster)."""
        check_copyable("source", engine)
        self.engine = engine
        self._server = _transfer_server(engine, bind_host)
        self._device = engine.model.mesh.devices.flat[0]
        # Ids of one sender are unique; a restarted sender starts elsewhere.
        self._ids = itertools.count(int.from_bytes(np.random.bytes(4), "little") << 20)

    @property
    def address(self) -> str:
        return self._server.address()

    def send(self, page_ids: np.ndarray) -> WireChunk:
        """Gathers the pages (global ids) onto one device and offers them; returns what
        the receiver pulls them by (nothing waits for the copy)."""
        chunk = read_pages(self.engine, np.asarray(page_ids))
        chunk = jax.device_put(chunk, jax.sharding.SingleDeviceSharding(self._device))
        uuid = next(self._ids)
        self._server.await_pull(uuid, [chunk.k, chunk.v])
        return WireChunk(self.address, uuid, tuple(chunk.k.shape), str(chunk.k.dtype),
                         len(page_ids))


class PageReceiver:
    """The decode side: pulls offered chunks and writes them into its engine's pages.
    `receive` runs on the engine's loop thread (it writes the cache)."""

    def __init__(self, engine, *, bind_host: str = "127.0.0.1", scatter=None):
        """scatter: `kv_copy.page_scatter(engine)` to share with in-process copies."""
        self.writer = PageWriter(engine, scatter)
        self.engine = engine
        self._server = _transfer_server(engine, bind_host)
        self._device = engine.model.mesh.devices.flat[0]
        self._connections = {}                  # sender address -> connection
        self._lock = threading.Lock()

    def pull(self, wire: WireChunk) -> KVCache:
        """The chunk's pages on this replica's devices (spread as its cache's heads are),
        waited for: a pull that fails (its sender died) raises here. Not waited for, the
        failure would surface in the write that consumes the chunk, whose output is the
        whole cache, and fail every later step of the replica."""
        k = self.engine.kv_cache.k
        check_same_layout((wire.shape, wire.dtype), (k.shape, k.dtype))
        with self._lock:
            connection = self._connections.get(wire.address)
            if connection is None:
                connection = self._connections[wire.address] = self._server.connect(
                    wire.address)
        spec = jax.ShapeDtypeStruct(wire.shape, np.dtype(wire.dtype),
                                    sharding=jax.sharding.SingleDeviceSharding(self._device))
        k, v = connection.pull(wire.uuid, [spec, spec])
        return jax.block_until_ready(
            jax.device_put(KVCache(k=k, v=v), self.writer.chunk_sharding))

    def receive(self, wire: WireChunk, page_ids: np.ndarray) -> None:
        """Pulls the chunk and writes its pages into `page_ids` (global ids, as many as it
        carries)."""
        if len(page_ids) != wire.num_pages:
            raise ValueError(f"{len(page_ids)} destination pages for a chunk of "
                             f"{wire.num_pages} pages")
        self.writer.write(np.asarray(page_ids), self.pull(wire))
