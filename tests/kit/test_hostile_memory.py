"""Memory that must stay bounded (issue 13): ``kvtier verify``, the testing kit's canonical
state and the facade's quiescence report cost what is in use, never the capacity; the
allocator's free state is O(pages ever allocated).

Each check replaces the allocator's O(capacity) views (``free_pages``, ``free_order``) with
a function that fails, runs at a capacity of 10**14 pages, and bounds the memory traced.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

import pytest

from kvtier.fsm.node.pages import PageAllocator
from kvtier.testing.machines import FacadeMachine
from kvtier.testing.verify import verify

HUGE = 10**14


def _no_capacity_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    def walk(self: PageAllocator) -> None:
        raise AssertionError(f"walked the {self.pool} pool's capacity")

    monkeypatch.setattr(PageAllocator, "free_pages", walk)
    monkeypatch.setattr(PageAllocator, "free_order", walk)


def _peak(call: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_free_state_is_the_free_list_without_the_capacity() -> None:
    a = PageAllocator("host", "kv", HUGE)
    assert a.free_state() == (HUGE, ())
    got = a.alloc(4)
    a.release([got[1], got[3]])
    assert a.free_state() == (HUGE - 4, (1, 3)) and a.alloc(1) == [3]
    small = PageAllocator("host", "kv", 6)
    small.alloc(4)
    small.release([1, 3])
    never, freed = small.free_state()
    assert small.free_order() == tuple(range(5, 5 - never, -1)) + freed == (5, 4, 1, 3)


def test_verify_at_a_huge_capacity_costs_what_is_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_capacity_walk(monkeypatch)
    setup = FacadeMachine.verify_setup(dev_units=HUGE // 4, host_units=HUGE // 4)
    res = verify(3, setup=setup)
    assert res.ok and res.depth == 3 and res.states > 10
    assert _peak(lambda: verify(2, setup=setup)) < 16 * 2**20


def test_kit_canonical_state_at_a_huge_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_capacity_walk(monkeypatch)
    m = FacadeMachine()
    m.setup(**FacadeMachine.verify_setup(dev_units=HUGE // 4, host_units=HUGE // 4).args)
    m.admit(req=0, key=["a", "b"], chunk=2, tail=False)
    m.kit_check()
    assert _peak(m.kit_canonical) < 2**20
    assert _peak(m.cache.outstanding) < 2**20 and not m.cache.quiescent()
