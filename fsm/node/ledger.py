"""The page ledger: one allocator per pool and cache group, and the pages held by callers.

Device pages are owned by tree nodes, by in-flight operations through their nodes, or
by callers (requests' own pages, handed out by :meth:`PageLedger.alloc_device` until
they are published into the tree or freed). The ledger tracks the callers' share;
``check_invariants`` counts the nodes' share (invariant ``conservation``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..checks import as_int
from ..errors import ConfigError, UsageError
from ..layout import CacheLayout
from .pages import PageAllocator
from ..records import Family

__all__ = ["PageLedger", "units_to_pages", "as_capacity"]


def units_to_pages(layout: CacheLayout, units: int, checkpoints: int | None = None) -> dict[str, int]:
    """Pages per group for a pool that holds ``units`` cache units of history and
    ``checkpoints`` continuation-state checkpoints (default: one per 4 units, at least 4).
    """
    ckpt = max(4, units // 4) if checkpoints is None else checkpoints
    out = {}
    for g in layout.groups:
        out[g.name] = units * layout.pages_per_unit(g) if g.family is Family.HISTORY else ckpt * g.state_pages
    return out


def as_capacity(layout: CacheLayout, value: int | Mapping[str, int], what: str) -> dict[str, int]:
    """A pool's capacity as pages per group, from units (int) or a mapping group -> pages.

    Raises:
        ConfigError: unknown or missing groups, or a count that is not an int >= 0.
    """
    if isinstance(value, Mapping):
        unknown = set(value) - {g.name for g in layout.groups}
        if unknown:
            raise ConfigError(f"{what}: unknown cache groups {sorted(unknown)}")
        missing = {g.name for g in layout.groups} - set(value)
        if missing:
            raise ConfigError(f"{what}: no capacity for cache groups {sorted(missing)}")
        return {g: as_int(v, f"{what}: pages of group {g!r}", error=ConfigError) for g, v in value.items()}
    try:
        units = as_int(value, what, error=ConfigError)
    except ConfigError:
        raise ConfigError(f"{what}: must be an int >= 0 (units) or a mapping group -> pages, got {value!r}") from None
    return units_to_pages(layout, units)


class PageLedger:
    """Allocators per pool and group, plus the device pages callers hold.

    Args:
        layout: the cache groups.
        device_pages: device capacity per group (pages).
        host_pages: host capacity per group, or ``None`` without a host tier.
    """

    def __init__(self, layout: CacheLayout, device_pages: Mapping[str, int],
                 host_pages: Mapping[str, int] | None) -> None:
        self.device = {g: PageAllocator("device", g, n) for g, n in device_pages.items()}
        self.host: dict[str, PageAllocator] | None = None
        if host_pages is not None:
            self.host = {g: PageAllocator("host", g, n) for g, n in host_pages.items()}
        self._callers: dict[str, set[int]] = {g.name: set() for g in layout.groups}

    # -- checks -------------------------------------------------------------------
    def check_need(self, need: Mapping[str, int]) -> None:
        """Raises UsageError for an unknown group or a count that is not an int >= 0."""
        for g, n in need.items():
            if g not in self.device:
                raise UsageError(f"unknown cache group {g!r}; groups: {sorted(self.device)}")
            as_int(n, f"page count for group {g!r}")

    def device_short(self, need: Mapping[str, int]) -> dict[str, int]:
        """group -> device pages missing for ``need`` (only the groups that are short)."""
        return {g: n - self.device[g].free for g, n in need.items() if n > self.device[g].free}

    def host_short(self, need: Mapping[str, int]) -> dict[str, int]:
        """group -> host pages missing for ``need`` (only the groups that are short)."""
        assert self.host is not None
        return {g: n - self.host[g].free for g, n in need.items() if n > self.host[g].free}

    # -- callers' pages -------------------------------------------------------------
    def caller_pages(self, group: str) -> frozenset[int]:
        """Device pages of ``group`` held by callers (a snapshot)."""
        return frozenset(self._callers[group])

    def caller_count(self) -> int:
        """Device pages held by callers, over every group."""
        return sum(len(s) for s in self._callers.values())

    def held_by_caller(self, group: str, page: int) -> bool:
        return page in self._callers[group]

    def all_held_by_caller(self, group: str, pages: Iterable[int]) -> bool:
        """Whether every one of ``pages`` is a caller's (one set operation)."""
        return self._callers[group].issuperset(pages)

    def alloc_for_callers(self, need: Mapping[str, int]) -> dict[str, list[int]]:
        """Allocate ``need`` (group -> pages) to callers. The caller checked that every
        group has room (:meth:`device_short`), so this cannot fail halfway."""
        out = {g: self.device[g].alloc(n) for g, n in need.items() if n > 0}
        for g, ps in out.items():
            self._callers[g].update(ps)
        return out

    def take_back(self, group: str, pages: Iterable[int]) -> None:
        """Callers' pages that became a node's (published, or adopted as a checkpoint)."""
        self._callers[group].difference_update(pages)

    def free_device(self, pages: Mapping[str, Iterable[int]]) -> None:
        """Return callers' device pages to the allocator.

        Raises:
            UsageError: unknown group.
            UsageError: a page is not a caller's (tree-owned, free or unknown); nothing freed.
        """
        lists = {g: list(p) for g, p in pages.items()}
        for g, ps in lists.items():
            if g not in self._callers:
                raise UsageError(f"free_device: unknown cache group {g!r}")
            held = self._callers[g]  # (every page a caller's, the common case, in one C-level pass)
            bad = [] if held.issuperset(ps) else [p for p in ps if p not in held]
            if bad or len(set(ps)) != len(ps):
                raise UsageError(f"free_device: pages {bad or ps} of group {g!r} are not held by a caller")
        for g, ps in lists.items():
            self._callers[g].difference_update(ps)
            self.device[g].release(ps)

    # -- nodes' pages ------------------------------------------------------------------
    def release_device(self, *maps: Mapping[str, list[int]]) -> dict[str, int]:
        """Free nodes' device pages; returns group -> pages freed."""
        got: dict[str, int] = {}
        for pm in maps:
            for g, pages in pm.items():
                self.device[g].release(pages)
                got[g] = got.get(g, 0) + len(pages)
        return got

    def release_host(self, *maps: Mapping[str, list[int]]) -> dict[str, int]:
        """Free nodes' host pages; returns group -> pages freed."""
        assert self.host is not None
        got: dict[str, int] = {}
        for pm in maps:
            for g, pages in pm.items():
                self.host[g].release(pages)
                got[g] = got.get(g, 0) + len(pages)
        return got
