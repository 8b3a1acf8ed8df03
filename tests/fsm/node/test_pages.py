"""PageAllocator (kvtier.fsm.node.pages): edge cases, released numpy page ids handed out as plain
ints, released non-integers refused, and the free state."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvtier.fsm.errors import CapacityError, ConfigError, InvariantViolation
from kvtier.fsm.node.pages import PageAllocator


def test_zero_capacity_is_allowed_and_empty() -> None:
    a = PageAllocator("device", "g", 0)
    assert (a.capacity, a.free, a.used) == (0, 0, 0)
    assert a.alloc(0) == []
    assert a.free_pages() == frozenset()
    with pytest.raises(CapacityError):
        a.alloc(1)


@pytest.mark.parametrize("capacity", [-1, True, 1.0, "3", None])
def test_bad_capacity_is_a_config_error_naming_pool_group_and_value(capacity: object) -> None:
    with pytest.raises(ConfigError) as exc:
        PageAllocator("host", "g0", capacity)  # type: ignore[arg-type]
    assert str(exc.value) == f"host pool of group 'g0': capacity must be an int >= 0, got {capacity!r}"


def test_attributes_and_counts() -> None:
    a = PageAllocator("host", "g1", 5)
    assert (a.pool, a.group, a.capacity) == ("host", "g1", 5)
    assert (a.free, a.used) == (5, 0)
    got = a.alloc(3)
    assert got == [0, 1, 2]  # lowest ids first
    assert (a.free, a.used) == (2, 3)
    assert a.free_pages() == frozenset({3, 4})
    assert [a.is_free(p) for p in range(5)] == [False, False, False, True, True]
    a.release([1])
    assert (a.free, a.used) == (3, 2)
    assert a.is_free(1) and not a.is_free(0)


def test_alloc_zero_takes_nothing() -> None:
    a = PageAllocator("device", "g", 4)
    assert a.alloc(0) == []
    assert (a.free, a.used) == (4, 0)
    assert a.free_pages() == frozenset(range(4))


def test_alloc_is_all_or_nothing() -> None:
    a = PageAllocator("device", "g", 2)
    with pytest.raises(CapacityError) as exc:
        a.alloc(3)
    assert (exc.value.pool, exc.value.group, exc.value.needed, exc.value.free) == ("device", "g", 3, 2)
    assert a.free == 2
    assert a.alloc(2) == [0, 1]


def _violation(a: PageAllocator, pages: list[int]) -> InvariantViolation:
    before = (a.free, a.free_pages())
    with pytest.raises(InvariantViolation) as exc:
        a.release(pages)
    assert (a.free, a.free_pages()) == before  # nothing released
    assert exc.value.invariant == "conservation"
    assert exc.value.subject == f"{a.pool} pool of group {a.group!r}"
    return exc.value


@pytest.mark.parametrize("page", [4, 5, -1])
def test_release_out_of_range(page: int) -> None:
    a = PageAllocator("device", "g", 4)
    a.alloc(4)
    err = _violation(a, [page])
    assert str(err) == ("invariant 'conservation' violated by device pool of group 'g': "
                        f"release of pages that are not allocated (or twice): [{page}]")


def test_release_of_a_free_page_is_a_double_free() -> None:
    a = PageAllocator("host", "g", 4)
    a.alloc(2)
    err = _violation(a, [3])
    assert str(err).endswith("release of pages that are not allocated (or twice): [3]")


def test_release_of_the_same_page_twice_in_one_call() -> None:
    a = PageAllocator("host", "g", 4)
    a.alloc(2)
    err = _violation(a, [0, 0])
    # no single page is bad on its own: the message lists the pages given
    assert str(err).endswith("release of pages that are not allocated (or twice): [0, 0]")


def test_release_mixed_good_and_bad_releases_nothing() -> None:
    a = PageAllocator("host", "g", 3)
    a.alloc(2)
    err = _violation(a, [0, 2])
    assert re.search(r"\(or twice\): \[2\]$", str(err))


def test_huge_capacity_costs_memory_only_for_pages_in_use() -> None:
    a = PageAllocator("device", "kv", 10**12)
    assert a.alloc(3) == [0, 1, 2] and (a.free, a.used) == (10**12 - 3, 3)
    a.release([1])
    assert a.is_free(1) and not a.is_free(0) and a.is_free(10**12 - 1) and not a.is_free(10**12)
    assert a.alloc(2) == [1, 3]


def test_free_order_is_the_reverse_allocation_order() -> None:
    a = PageAllocator("host", "kv", 6)
    assert a.free_order() == (5, 4, 3, 2, 1, 0)
    assert a.alloc(4) == [0, 1, 2, 3]
    a.release([2, 0])
    assert a.free_order() == (5, 4, 2, 0) and a.free_pages() == {0, 2, 4, 5}
    assert a.alloc(3) == [0, 2, 4]  # last freed first, then the lowest never-used id
    assert a.free_order() == (5,) and a.free_pages() == {5}


def test_alloc_counts_are_checked_and_zero_is_nothing() -> None:
    a = PageAllocator("device", "kv", 4)
    assert a.is_free(0) and a.is_free(3) and not a.is_free(-1)
    assert a.alloc(0) == [] and a.free == 4
    for bad in (-1, True, 1.0):
        with pytest.raises(ConfigError) as exc:
            a.alloc(bad)  # type: ignore[arg-type]
        assert str(exc.value) == f"device pool of group 'kv': page count must be an int >= 0, got {bad!r}"
    assert a.free == 4 and a.free_order() == (3, 2, 1, 0)


def test_released_numpy_page_ids_are_stored_and_handed_out_as_plain_ints() -> None:
    """pages.py:98: numpy integer page ids are converted to plain ints on release."""
    a = PageAllocator("device", "kv", 4)
    assert a.alloc(3) == [0, 1, 2]
    a.release([np.int64(1), np.int32(2)])
    state = a.free_state()
    assert state == (1, (1, 2))
    assert [type(p) for p in state[1]] == [int, int]
    got = a.alloc(2)
    assert got == [2, 1] and [type(p) for p in got] == [int, int]
    assert a.free_pages() == frozenset({3}) and a.used == 3


@pytest.mark.parametrize("bad", [1.0, True, "1"])
def test_releasing_a_page_id_that_is_not_an_integer_is_refused(bad: object) -> None:
    """pages.py:98: a float, a bool or a str is not a page id (nothing is released)."""
    a = PageAllocator("host", "kv", 4)
    assert a.alloc(2) == [0, 1]
    with pytest.raises(InvariantViolation, match="release of pages that are not allocated"):
        a.release([bad])
    assert a.free_state() == (2, ()) and a.used == 2 and a.free == 2


def test_free_state_counts_the_ids_never_allocated() -> None:
    """pages.py:119: (capacity - ids handed out so far, the freed ids in release order)."""
    a = PageAllocator("device", "kv", 8)
    assert a.free_state() == (8, ())
    assert a.alloc(3) == [0, 1, 2]
    assert a.free_state() == (5, ())
    a.release([1, 0])
    assert a.free_state() == (5, (1, 0))
    assert a.alloc(1) == [0]
    assert a.free_state() == (5, (1,))
    assert a.alloc(6) == [1, 3, 4, 5, 6, 7]
    assert a.free_state() == (0, ())
