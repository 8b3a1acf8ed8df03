"""What one run of the reference scheduler did (:class:`RunStats`), the wall time spent
inside the cache's calls (:class:`TimedCache`), and :func:`percentile`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from ..tiered import TieredCache

__all__ = ["RunStats", "TimedCache", "percentile"]


@dataclass
class RunStats:
    """What one scheduler run did (tokens, counts, modeled seconds)."""

    steps: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    history_hit_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    retractions: int = 0
    aborts: int = 0
    abort_reasons: dict[str, int] = field(default_factory=dict)
    loadback_bytes: int = 0
    writeback_bytes: int = 0
    loadback_pages: int = 0
    writeback_pages: int = 0
    modeled_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    finished: int = 0
    kvtier_s: float = 0.0  #: wall seconds spent inside the cache's calls (bookkeeping)
    kvtier_decode_s: float = 0.0  #: of which the per-token calls of decode steps
    #: (modeled seconds, hit rate so far, device pool used fraction, host pool used fraction)
    timeline: list[tuple[float, float, float, float]] = field(default_factory=list)


class TimedCache:
    """The cache, with the wall time of every call added to ``stats.kvtier_s``."""

    def __init__(self, cache: TieredCache, stats: RunStats) -> None:
        self._cache = cache
        self._stats = stats
        self.decode = False  # set around per-token decode calls

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._cache, name)
        if not callable(fn):
            return fn
        stats = self._stats

        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = perf_counter() - t0
                stats.kvtier_s += dt
                if self.decode:
                    stats.kvtier_decode_s += dt

        setattr(self, name, call)  # bind once: later calls skip __getattr__
        return call


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))
    return s[k]
