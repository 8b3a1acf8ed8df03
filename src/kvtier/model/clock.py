"""Measured time for the reference scheduler: :class:`WallClock` (the
:class:`~kvtier.scheduler.Clock` protocol)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["WallClock"]


class WallClock:
    """Measured seconds for the scheduler (``ReferenceScheduler(clock=...)``): wall time
    since creation, plus idle gaps skipped (:meth:`skip_to`: nothing runs, nothing is in
    flight), minus the time spent in :meth:`excluded` blocks (verification work).

    Args:
        sync: called at the edges of an excluded block so queued device work is
            counted on the right side (``torch.cuda.synchronize`` on a GPU).
    """

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self._t0 = time.perf_counter()
        self._offset = 0.0
        self._sync = sync
        self.excluded_s = 0.0
        self.skipped_s = 0.0

    def now(self) -> float:
        return time.perf_counter() - self._t0 + self._offset

    def skip_to(self, t: float) -> None:
        d = t - self.now()
        if d > 0:
            self._offset += d
            self.skipped_s += d

    @contextmanager
    def excluded(self) -> Iterator[None]:
        if self._sync is not None:
            self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            d = time.perf_counter() - t0
            self._offset -= d
            self.excluded_s += d
