"""serving.gc_freeze: the process's heap frozen out of the cyclic collector while a holder
lives, and given back to it when the last one releases; benchmarks/gc_pauses.py on the tiny
model."""

import dataclasses
import gc
import weakref

import pytest

from benchmarks.gc_pauses import one_run
from serving.gc_freeze import HeapFreeze, frozen_holders
from tests.test_server import TINY_ENGINE


@pytest.fixture(autouse=True)
def no_holder_before_or_after():
    assert frozen_holders() == 0 and gc.get_freeze_count() == 0, \
        "another holder is alive in this process: the counts below would be off"
    yield
    assert frozen_holders() == 0
    gc.unfreeze()     # whatever a failed test left


class Node:
    def __init__(self):
        self.me = self          # a reference cycle: only the cyclic collector frees it


def test_objects_alive_at_the_freeze_are_not_walked_until_the_last_holder_releases():
    cycle = Node()
    alive = weakref.ref(cycle)
    first = HeapFreeze()
    assert gc.get_freeze_count() > 0 and frozen_holders() == 1
    second = HeapFreeze()
    del cycle                   # garbage now, but frozen: no collection reaches it
    gc.collect()
    assert alive() is not None
    first.release()
    first.release()             # idempotent: still one holder
    assert frozen_holders() == 1 and gc.get_freeze_count() > 0
    gc.collect()
    assert alive() is not None
    second.release()
    assert frozen_holders() == 0 and gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None      # back with the collector, and reclaimed


def test_refreeze_takes_in_what_was_made_since_and_nothing_after_release():
    holder = HeapFreeze()
    frozen = gc.get_freeze_count()
    made_since = [Node() for _ in range(1000)]
    holder.refreeze()
    assert gc.get_freeze_count() >= frozen + len(made_since)
    holder.release()
    holder.refreeze()           # released: no freeze again
    assert gc.get_freeze_count() == 0


def test_garbage_made_after_the_freeze_is_still_collected():
    holder = HeapFreeze()
    try:
        cycle = Node()
        alive = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert alive() is None
    finally:
        holder.release()


def test_the_gc_pauses_benchmark_runs_and_a_frozen_server_leaves_the_collector_little_to_walk():
    spec = {"model": "tiny", "engine": dataclasses.asdict(TINY_ENGINE), "cache_dir": False,
            "requests": 3, "output_tokens": 4, "measure_serving": True}
    frozen, unfrozen = (one_run({**spec, "freeze_gc": f}) for f in (True, False))
    # What a full collection walks: what was made since the freeze, not the start-up heap.
    assert frozen["tracked"] < frozen["frozen"] / 4
    assert unfrozen["frozen"] == 0 and unfrozen["tracked"] > frozen["frozen"] / 2
    for run in (frozen, unfrozen):
        assert run["tpot_p99_ms"] > 0 and run["max_token_gap_ms"] > 0


def test_server_metrics_count_every_collection_by_generation_until_closed():
    from prometheus_client.parser import text_string_to_metric_families

    from serving.metrics import ServerMetrics

    def counts(metrics) -> dict[str, float]:
        family, = [f for f in text_string_to_metric_families(metrics.text())
                   if f.name == "medha_gc_pause_seconds"]
        return {s.labels["generation"]: s.value for s in family.samples
                if s.name.endswith("_count")}

    metrics = ServerMetrics()
    try:
        assert counts(metrics) == {"0": 0, "1": 0, "2": 0}
        gc.collect(0)
        gc.collect(0)
        gc.collect()
        seen = counts(metrics)
        assert seen["0"] >= 2 and seen["2"] >= 1
    finally:
        metrics.close()
    assert metrics.gc_pauses._time not in gc.callbacks
    gc.collect()
    assert counts(metrics) == seen        # no longer timed
