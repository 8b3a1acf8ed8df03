"""Transfer statistics: per flush and cumulative, per direction."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

from kvtier.fsm import Direction

__all__ = ["DirectionStats", "TransferStats"]

log = logging.getLogger("kvtier.transfer")


@dataclass(slots=True)
class DirectionStats:
    """Counters of one direction.

    Attributes:
        flushes: flushes that issued work in this direction.
        ops: operations issued; failed_ops: those acknowledged with ``ok=False``.
        pages: page pairs (after merging); spans: contiguous runs.
        tensor_refs: (group, component, layer) tensor pairs summed over chunks.
        rows: copy descriptors (spans x refs) summed over chunks.
        copy_calls: copy API calls (``copy_`` / ``index_copy_``).
        kernel_launches: kernel launches; chunks: layer chunks issued.
        bytes: bytes copied.
        seconds: device time of the completed flushes (events on the transfer stream,
            or host time for synchronous backends); flushes whose backend does not
            time them add nothing (``timed_bytes`` counts the bytes that were timed).
    """

    flushes: int = 0
    ops: int = 0
    failed_ops: int = 0
    pages: int = 0
    spans: int = 0
    tensor_refs: int = 0
    rows: int = 0
    copy_calls: int = 0
    kernel_launches: int = 0
    chunks: int = 0
    bytes: int = 0
    timed_bytes: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float | None:
        """Timed bytes / seconds / 1e9 (GB/s), None before anything was timed."""
        return self.timed_bytes / self.seconds / 1e9 if self.seconds > 0 else None

    def add(self, other: DirectionStats) -> None:
        for name in DirectionStats.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, float | int | None]:
        d: dict[str, float | int | None] = dict(asdict(self))
        d["gbps"] = self.gbps
        return d


class TransferStats:
    """Per-flush and cumulative :class:`DirectionStats`, logged at DEBUG at most once
    every ``log_interval_s`` seconds (from :meth:`maybe_log`)."""

    def __init__(self, log_interval_s: float = 10.0) -> None:
        self.last: dict[Direction, DirectionStats] = {}
        self.total: dict[Direction, DirectionStats] = {d: DirectionStats() for d in Direction}
        self.flushes = 0
        self.log_interval_s = log_interval_s
        self._last_log = time.monotonic()

    def begin_flush(self) -> None:
        self.flushes += 1
        self.last = {}

    def issued(self, direction: Direction, s: DirectionStats) -> None:
        """Count what a flush issued (timing comes later, through :meth:`timed`)."""
        self.last[direction] = s
        self.total[direction].add(s)

    def timed(self, direction: Direction, s: DirectionStats, nbytes: int, seconds: float,
              failed_ops: int) -> None:
        """Add a completed flush's device time (``s`` is its per-flush record)."""
        s.seconds += seconds
        s.timed_bytes += nbytes
        s.failed_ops += failed_ops
        t = self.total[direction]
        t.seconds += seconds
        t.timed_bytes += nbytes
        t.failed_ops += failed_ops

    def as_dict(self) -> dict[str, object]:
        return {
            "flushes": self.flushes,
            "last_flush": {d.value: s.as_dict() for d, s in self.last.items()},
            "cumulative": {d.value: s.as_dict() for d, s in self.total.items()},
        }

    def maybe_log(self) -> None:
        if not log.isEnabledFor(logging.DEBUG):
            return
        now = time.monotonic()
        if now - self._last_log < self.log_interval_s:
            return
        self._last_log = now
        for d, s in self.total.items():
            if s.flushes:
                g = s.gbps
                log.debug("transfer %s: %d flushes, %d ops (%d failed), %d pages, %d spans, %d refs, "
                          "%d calls, %d launches, %.1f MB, %s", d.value, s.flushes, s.ops, s.failed_ops,
                          s.pages, s.spans, s.tensor_refs, s.copy_calls, s.kernel_launches, s.bytes / 1e6,
                          "untimed" if g is None else f"{g:.1f} GB/s")
