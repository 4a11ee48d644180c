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
