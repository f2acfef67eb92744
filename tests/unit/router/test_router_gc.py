"""The router process keeps the cycle collector out of its request path (main.collect_rarely)."""

from __future__ import annotations

import gc

from kvstrata.router.main import _YOUNG_COLLECTION_ALLOCATIONS, collect_rarely


def test_start_up_objects_are_frozen_and_young_collections_wait_for_many_allocations() -> None:
    threshold, frozen = gc.get_threshold(), gc.get_freeze_count()
    loaded = [[i] for i in range(1_000)]  # tracked objects alive when the router starts serving
    try:
        collect_rarely()
        assert gc.get_freeze_count() >= frozen + len(loaded)
        # Only the young generation's threshold changes: a young collection after 50,000 net
        # allocations instead of 700; the older generations keep their ratios.
        assert gc.get_threshold() == (_YOUNG_COLLECTION_ALLOCATIONS, *threshold[1:])
        assert threshold[0] < _YOUNG_COLLECTION_ALLOCATIONS
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
