"""Page allocators: one per pool (device or host) per cache group.

Page ids are ``0 .. capacity-1``. Allocation is all-or-nothing (invariant ``atomic_admission``). The
allocator keeps the free pages (memory proportional to the pages ever freed, not to the
capacity); who owns each allocated page is checked by
``check_invariants`` from the owners' side (invariant ``conservation``).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..checks import plain_int
from ..errors import CapacityError, ConfigError, InvariantViolation

__all__ = ["PageAllocator", "MAX_POOL_PAGES"]

#: The most pages one pool of one cache group may have: 2**53, so that page ids and counts
#: stay exact as JSON numbers and float64 statistics. A larger capacity raises ConfigError.
MAX_POOL_PAGES = 2**53

_INT = {int}


class PageAllocator:
    """Free-list allocator of page ids for one pool and one cache group.

    Args:
        pool: ``"device"`` or ``"host"`` (for messages).
        group: cache group name (for messages).
        capacity: number of pages (0 .. :data:`MAX_POOL_PAGES`).

    Raises:
        ConfigError: a capacity that is not an int in 0 .. MAX_POOL_PAGES.
    """

    __slots__ = ("pool", "group", "capacity", "_next", "_released", "_released_set")

    def __init__(self, pool: str, group: str, capacity: int) -> None:
        cap = plain_int(capacity)
        if cap is None or cap < 0:
            raise ConfigError(f"{pool} pool of group {group!r}: capacity must be an int >= 0, got {capacity!r}")
        if cap > MAX_POOL_PAGES:
            raise ConfigError(f"{pool} pool of group {group!r}: capacity {cap} pages is above the maximum "
                              f"{MAX_POOL_PAGES} (2**53: page ids stay exact as JSON numbers)")
        capacity = cap
        self.pool = pool
        self.group = group
        self.capacity = capacity
        # Memory is O(pages ever released), not O(capacity): ids >= _next were never
        # allocated; freed ids wait on a stack and are reused last-freed first, before the
        # lowest never-used ids.
        self._next = 0
        self._released: list[int] = []
        self._released_set: set[int] = set()

    @property
    def free(self) -> int:
        """Free pages."""
        return self.capacity - self._next + len(self._released)

    @property
    def used(self) -> int:
        """Allocated pages."""
        return self._next - len(self._released)

    def alloc(self, n: int) -> list[int]:
        """Allocate ``n`` pages, all or nothing: the most recently freed first, then the
        lowest ids never allocated.

        Raises:
            ConfigError: ``n`` is not an int >= 0.
            CapacityError: fewer than ``n`` pages are free (nothing allocated).
        """
        count = n if type(n) is int else plain_int(n)  # numpy integers too
        if count is None or count < 0:
            raise ConfigError(f"{self.pool} pool of group {self.group!r}: page count must be an int >= 0, "
                              f"got {n!r}")
        n = count
        free = self.free
        if n > free:
            raise CapacityError(self.pool, self.group, n, free)
        k = min(n, len(self._released))
        out = self._released[len(self._released) - k:]
        del self._released[len(self._released) - k:]
        out.reverse()
        self._released_set.difference_update(out)
        out.extend(range(self._next, self._next + n - k))
        self._next += n - k
        return out

    def release(self, pages: Iterable[int]) -> None:
        """Return pages to the free list.

        Raises:
            InvariantViolation (``conservation``): a page is out of range or already free
                (a double free); nothing is released then.
        """
        given = pages if type(pages) is list else list(pages)
        if len(given) == 1:  # (one page: the common case of exact eviction, without sets)
            p = given[0]
            if type(p) is int and 0 <= p < self._next and p not in self._released_set:
                self._released.append(p)
                self._released_set.add(p)
                return
        elif given:
            # the common case in C: distinct plain ints, allocated, none already free
            fresh = set(given)
            if (len(fresh) == len(given) and set(map(type, given)) == _INT and min(given) >= 0
                    and max(given) < self._next and fresh.isdisjoint(self._released_set)):
                self._released.extend(given)
                self._released_set |= fresh
                return
        plain = [p if type(p) is int else plain_int(p) for p in given]  # numpy integers: plain ints
        bad = [g for g, p in zip(given, plain) if p is None or not self._allocated(p)]
        ids = [p for p in plain if p is not None]
        if bad or len(set(ids)) != len(ids):
            raise InvariantViolation("conservation", f"{self.pool} pool of group {self.group!r}",
                                     f"release of pages that are not allocated (or twice): {bad or given}")
        self._released.extend(ids)
        self._released_set.update(ids)

    def _allocated(self, page: int) -> bool:
        return 0 <= page < self._next and page not in self._released_set

    def is_free(self, page: int) -> bool:
        """Whether ``page`` (an id in ``0 .. capacity-1``) is free; ``False`` out of range."""
        return 0 <= page < self.capacity and not self._allocated(page)

    def free_state(self) -> tuple[int, tuple[int, ...]]:
        """The free list in O(pages ever allocated), never O(capacity): (the number of ids
        never allocated, which are handed out lowest first after the freed ones; the freed
        ids in reverse reuse order, the next one allocated last). Two allocators with the
        same capacity and equal free states allocate alike."""
        return self.capacity - self._next, tuple(self._released)

    def free_order(self) -> tuple[int, ...]:
        """Every free page id, in reverse allocation order (the next page allocated is last);
        O(capacity), for tests and canonical state hashes."""
        return tuple(range(self.capacity - 1, self._next - 1, -1)) + tuple(self._released)

    def free_pages(self) -> frozenset[int]:
        """A snapshot of the free page ids (for invariant checks; O(capacity))."""
        return frozenset(range(self._next, self.capacity)) | self._released_set
