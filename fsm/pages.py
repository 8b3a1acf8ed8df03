"""Page allocators: one per pool (device or host) per cache group.

Page ids are ``0 .. capacity-1``. Allocation is all-or-nothing (invariant 11). The
allocator keeps the free pages (memory proportional to the pages ever freed, not to the
capacity); who owns each allocated page is checked by
``check_invariants`` from the owners' side (invariant 13: conservation).
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import CapacityError, ConfigError, InvariantViolation

__all__ = ["PageAllocator"]


class PageAllocator:
    """Free-list allocator of page ids for one pool and one cache group.

    Args:
        pool: ``"device"`` or ``"host"`` (for messages).
        group: cache group name (for messages).
        capacity: number of pages (>= 0).

    Raises:
        ConfigError: negative or non-int capacity.
    """

    __slots__ = ("pool", "group", "capacity", "_next", "_released", "_released_set")

    def __init__(self, pool: str, group: str, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ConfigError(f"{pool} pool of group {group!r}: capacity must be an int >= 0, got {capacity!r}")
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
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"{self.pool} pool of group {self.group!r}: page count must be an int >= 0, "
                              f"got {n!r}")
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
        pages = list(pages)
        bad = [p for p in pages if not self._allocated(p)]
        if bad or len(set(pages)) != len(pages):
            raise InvariantViolation("conservation", f"{self.pool} pool of group {self.group!r}",
                                     f"release of pages that are not allocated (or twice): {bad or pages}")
        self._released.extend(pages)
        self._released_set.update(pages)

    def _allocated(self, page: int) -> bool:
        return 0 <= page < self._next and page not in self._released_set

    def is_free(self, page: int) -> bool:
        """Whether ``page`` (an id in ``0 .. capacity-1``) is free; ``False`` out of range."""
        return 0 <= page < self.capacity and not self._allocated(page)

    def free_order(self) -> tuple[int, ...]:
        """Every free page id, in reverse allocation order (the next page allocated is last);
        O(capacity), for tests and canonical state hashes."""
        return tuple(range(self.capacity - 1, self._next - 1, -1)) + tuple(self._released)

    def free_pages(self) -> frozenset[int]:
        """A snapshot of the free page ids (for invariant checks; O(capacity))."""
        return frozenset(range(self._next, self.capacity)) | self._released_set
