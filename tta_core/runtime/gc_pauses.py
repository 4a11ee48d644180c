"""Keep Python's full garbage collections off a real-time loop.

A generation-2 collection walks every tracked object; in a process that has loaded torch, a
model and a stream, that is tens of ms: in the streaming benchmark at a high frame rate each
full collection cost a batch its deadline. After `gc.freeze()` the objects alive at start-up
(modules, the model, the method) move to a permanent generation that later collections skip,
so collections walk only what serving allocates since. Reference counting still frees frozen
objects; only reference cycles among them are no longer collected.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_startup_heap() -> int:
    """Collect once, then freeze every surviving object (a node calls it when it is ready
    to serve). Returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def collect_frozen() -> int:
    """Collect what became garbage among the frozen objects (a model freed by a node's
    cleanup: its cycles are never collected while frozen), then freeze the survivors
    again. Returns the number of objects collected."""
    gc.unfreeze()
    found = gc.collect()
    gc.freeze()
    return found


@contextmanager
def frozen_heap() -> Iterator[int]:
    """`freeze_startup_heap()` for the block, unfrozen after (a benchmark's timed stream)."""
    try:
        yield freeze_startup_heap()
    finally:
        gc.unfreeze()
