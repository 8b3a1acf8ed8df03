"""Page allocators: one per pool (device or host) per cache group.

Page ids are ``0 .. capacity-1``. Allocation is all-or-nothing (invariant 11). The
allocator keeps the free set; who owns each allocated page is checked by
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

    __slots__ = ("pool", "group", "capacity", "_free", "_free_set")

    def __init__(self, pool: str, group: str, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ConfigError(f"{pool} pool of group {group!r}: capacity must be an int >= 0, got {capacity!r}")
        self.pool = pool
        self.group = group
        self.capacity = capacity
        # pop from the end: lowest ids first
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._free_set: set[int] = set(self._free)

    @property
    def free(self) -> int:
        """Free pages."""
        return len(self._free)

    @property
    def used(self) -> int:
        """Allocated pages."""
        return self.capacity - len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Allocate ``n`` pages, all or nothing.

        Raises:
            CapacityError: fewer than ``n`` pages are free (nothing allocated).
        """
        if n > len(self._free):
            raise CapacityError(self.pool, self.group, n, len(self._free))
        if n <= 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        self._free_set.difference_update(out)
        out.reverse()
        return out

    def release(self, pages: Iterable[int]) -> None:
        """Return pages to the free list.

        Raises:
            InvariantViolation (``conservation``): a page is out of range or already free
                (a double free); nothing is released then.
        """
        pages = list(pages)
        bad = [p for p in pages if not (0 <= p < self.capacity) or p in self._free_set]
        if bad or len(set(pages)) != len(pages):
            raise InvariantViolation("conservation", f"{self.pool} pool of group {self.group!r}",
                                     f"release of pages that are not allocated (or twice): {bad or pages}")
        self._free.extend(pages)
        self._free_set.update(pages)

    def is_free(self, page: int) -> bool:
        return page in self._free_set

    def free_pages(self) -> frozenset[int]:
        """A snapshot of the free page ids (for invariant checks)."""
        return frozenset(self._free_set)
