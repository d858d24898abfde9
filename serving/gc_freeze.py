"""Keeping Python's cyclic garbage collector out of the serving path's tail latency.

After start-up a serving process holds a large heap that lives as long as it does: JAX's
traced and compiled programs, the model's pytree, the tokenizer, the scheduler's tables
(~220K tracked objects for SmolLM2 on the CPU). A collection of the collector's oldest
generation walks all of it with every Python thread stopped: 300-490 ms on the 2-core
CPU, the loop thread's step, and so every stream's next token, delayed by that much
whenever one falls while serving. The heap holds no garbage worth the walk: what the
serving loop allocates per step is acyclic and reference counting frees it.

`gc.freeze()` moves every object alive at that moment to a permanent generation that no
collection walks; a full collection then walks only what came after (vLLM freezes its
engine and server processes after start-up, SGLang after warm-up, for the same reason).
What it costs: a frozen object that later becomes part of a garbage cycle is not
reclaimed until `gc.unfreeze()`. So a Server freezes when it is ready (and again when
its background compiles are done: they add their programs), and the last Server of the
process to close unfreezes, which returns the frozen heap to the collector.

The collector's generations are the process's, so the holders are counted here, for the
process: several Servers in one process (tests, a notebook) share one freeze.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0


class HeapFreeze:
    """One holder of the process's frozen heap: frozen from construction until release()."""

    def __init__(self):
        global _holders
        with _lock:
            # The young generations only (milliseconds; a full collection walks the whole
            # heap, 0.3 s here, and a test process builds a hundred Servers): what reached
            # the oldest generation survived two collections, and the rare garbage among it
            # is reclaimed when the last holder unfreezes.
            gc.collect(1)
            gc.freeze()
            _holders += 1
        self._held = True

    def refreeze(self) -> None:
        """Freezes what was made since (a background warm-up's programs), the young
        generations collected first as at construction."""
        with _lock:
            if self._held:
                gc.collect(1)
                gc.freeze()

    def release(self) -> None:
        """Idempotent; the process's last holder unfreezes the heap."""
        global _holders
        with _lock:
            if not self._held:
                return
            self._held = False
            _holders -= 1
            if _holders == 0:
                gc.unfreeze()


def frozen_holders() -> int:
    """How many HeapFreeze holders this process has (0: the heap is not frozen by us)."""
    return _holders
