"""tta_core.runtime.gc_pauses: the start-up heap frozen for serving (full collections
then walk only what was allocated since), unfrozen after a benchmark's stream."""

from __future__ import annotations

import gc

import pytest

from tta_core.runtime.gc_pauses import freeze_startup_heap, frozen_heap


def test_frozen_heap_freezes_for_the_block_and_unfreezes_after() -> None:
    gc.unfreeze()
    keep = [[i] for i in range(1000)]  # tracked objects alive at "start-up"
    with frozen_heap() as n:
        assert n >= 1000 and gc.get_freeze_count() >= 1000
    assert gc.get_freeze_count() == 0
    assert freeze_startup_heap() >= 1000
    gc.unfreeze()
    del keep


@pytest.mark.slow
def test_a_full_collection_walks_fewer_objects_once_frozen() -> None:
    gc.unfreeze()
    junk = [[i] for i in range(200_000)]
    gc.collect()
    before = len(gc.get_objects(generation=2))
    with frozen_heap():
        after = len(gc.get_objects(generation=2))
    assert before >= 200_000 and after < before - 150_000
    del junk


def test_collect_frozen_frees_cycles_that_became_garbage_while_frozen() -> None:
    """A model freed after the heap was frozen (a node's cleanup): its reference cycles are
    collected, what still lives is frozen again."""
    import weakref

    from tta_core.runtime.gc_pauses import collect_frozen

    class Model:
        pass

    gc.unfreeze()
    model, alive = Model(), [[i] for i in range(100)]
    model.me = model  # a cycle: reference counting alone never frees it
    ref = weakref.ref(model)
    freeze_startup_heap()
    del model
    gc.collect()
    assert ref() is not None  # frozen: a plain collection skips it
    assert collect_frozen() >= 1 and ref() is None
    assert gc.get_freeze_count() >= len(alive)  # the survivors frozen again
    gc.unfreeze()
