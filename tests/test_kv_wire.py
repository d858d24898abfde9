"""KV pages between processes (serving.kv_wire): a child process at tp=2 offers pages of
its cache, this process pulls them into a replica of another mesh; they land bit-equal,
and a cache of another layout is refused before anything moves."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from benchmarks.report import json_line_child
from medha_jax.engine import Engine
from medha_jax.model import load_model
from meshes import ParallelConfig, make_mesh
from serving.kv_wire import PageReceiver, PageSender, WireChunk
from tests.test_server import TINY_ENGINE

SOURCE_PAGES = [3, 17, 4, 60, 61]

# The sender: a tiny replica at tp=2 whose cache holds seeded values (V = -K); it offers
# SOURCE_PAGES once per destination (an offer is pulled once), prints the WireChunks, and
# keeps its transfer server up until told to stop.
SENDER = """
import dataclasses, json, sys
import jax, numpy as np
from medha_jax.engine import Engine
from medha_jax.model import KVCache, load_model
from meshes import ParallelConfig, make_mesh
from serving.kv_wire import PageSender
from tests.test_server import TINY_ENGINE
model = load_model("tiny", mesh=make_mesh(ParallelConfig(tp=2), jax.devices()[:2]),
                   verbose=False)
engine = Engine(model, TINY_ENGINE)
k = engine.kv_cache.k
values = np.random.default_rng(0).standard_normal(k.shape).astype(np.float32)
engine.kv_cache = KVCache(*(jax.device_put(v, k.sharding) for v in (values, -values)))
sender = PageSender(engine)
wires = [sender.send(np.array(json.loads(sys.argv[1]))) for _ in range(2)]
print(json.dumps({"cache_shape": k.shape, "wires": [dataclasses.asdict(w) for w in wires]}),
      flush=True)
sys.stdin.readline()
"""


@pytest.fixture(scope="module")
def sender():
    """The child's cache values (seeded) and the two WireChunks of SOURCE_PAGES it offers."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    with json_line_child(SENDER, [json.dumps(SOURCE_PAGES)], env) as sent:
        values = np.random.default_rng(0).standard_normal(sent["cache_shape"]).astype(np.float32)
        yield values, [WireChunk.from_dict(fields) for fields in sent["wires"]]


@pytest.mark.parametrize("offer, destination", [(0, dict(tp=1)), (1, dict(kvp=2))])
def test_pages_pulled_from_another_process_land_bit_equal(sender, offer, destination):
    parallel = ParallelConfig(**destination)
    model = load_model("tiny", mesh=make_mesh(parallel, jax.devices()[4:4 + parallel.num_devices]),
                       verbose=False)
    engine = Engine(model, TINY_ENGINE)
    expected, wires = sender
    destination_pages = np.array([100, 0, 5, 6, 127])
    PageReceiver(engine).receive(wires[offer], destination_pages)
    k, v = np.asarray(engine.kv_cache.k), np.asarray(engine.kv_cache.v)
    np.testing.assert_array_equal(k[:, destination_pages], expected[:, SOURCE_PAGES])
    np.testing.assert_array_equal(v[:, destination_pages], -expected[:, SOURCE_PAGES])
    untouched = np.setdiff1d(np.arange(k.shape[1]), destination_pages)
    assert not k[:, untouched].any() and not v[:, untouched].any()
    assert engine.kv_cache.k.sharding == engine._kv_cache_spec.k.sharding


def test_a_chunk_of_another_layout_is_refused_before_pulling():
    engine = Engine(load_model("tiny", verbose=False), TINY_ENGINE)
    receiver = PageReceiver(engine)
    shape = engine.kv_cache.k.shape
    other = WireChunk("127.0.0.1:1", 1, (shape[0], 1, shape[2] * 2, shape[3]), "float32", 1)
    with pytest.raises(ValueError, match="different layouts cannot exchange pages"):
        receiver.receive(other, np.array([0]))
    with pytest.raises(ValueError, match="2 destination pages for a chunk of 1 pages"):
        receiver.receive(dataclasses.replace(other, shape=(shape[0], 1, *shape[2:])),
                         np.array([0, 1]))
