"""The conductor settles the garbage collector once it serves (``conductor.main``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from conductor.main import GC_YOUNG_THRESHOLD, settle_garbage_collector


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


@pytest.mark.usefixtures("restored_gc")
def test_startup_objects_are_frozen_and_young_collections_are_rarer() -> None:
    built_at_startup = [[index] for index in range(1000)]  # tracked containers
    _, older, oldest = gc.get_threshold()
    settle_garbage_collector()
    assert gc.get_freeze_count() >= len(built_at_startup)
    assert all(gc.is_tracked(item) for item in built_at_startup)
    assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, older, oldest)
    # A collection now leaves the frozen objects alone: they are in no generation.
    tracked_in_generations = len(gc.get_objects())
    assert tracked_in_generations < gc.get_freeze_count()
