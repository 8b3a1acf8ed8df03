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
        sm_bytes, sm_copies: bytes and contiguous copies (runs x refs) moved by the SM
            kernel (``numba``, ``hybrid``).
        ce_bytes, ce_copies, ce_calls: bytes, copies and driver calls of batched
            copy-engine copies (``hybrid``).
        sm_timed_bytes, sm_seconds, ce_timed_bytes, ce_seconds: ``timed_bytes`` and
            ``seconds`` of the flushes that used that engine alone.
        waits: chunks whose kernel part waited for a running loadback (``hybrid``).
        stage_bytes, stage_copies: bytes and copy-engine copies of the staging path
            (``hybrid`` with a page-major host pool, :mod:`.backends.staging`).
        ring_waits: staging slots reused while their last copy was still running
            (back-pressure: the copy waits on the device for the slot).
        max_blocks: thread blocks (= SMs at one block per SM) of the largest launch;
            a maximum, not a sum.
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
    sm_bytes: int = 0
    sm_copies: int = 0
    ce_bytes: int = 0
    ce_copies: int = 0
    ce_calls: int = 0
    sm_timed_bytes: int = 0
    sm_seconds: float = 0.0
    ce_timed_bytes: int = 0
    ce_seconds: float = 0.0
    waits: int = 0
    stage_bytes: int = 0
    stage_copies: int = 0
    ring_waits: int = 0
    max_blocks: int = 0

    @property
    def gbps(self) -> float | None:
        """Timed bytes / seconds / 1e9 (GB/s), None before anything was timed."""
        return self.timed_bytes / self.seconds / 1e9 if self.seconds > 0 else None

    def add(self, other: DirectionStats) -> None:
        for name in DirectionStats.__slots__:
            if name == "max_blocks":
                self.max_blocks = max(self.max_blocks, other.max_blocks)
            else:
                setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, float | int | None]:
        d: dict[str, float | int | None] = dict(asdict(self))
        d["gbps"] = self.gbps
        d["sm_gbps"] = self.sm_timed_bytes / self.sm_seconds / 1e9 if self.sm_seconds > 0 else None
        d["ce_gbps"] = self.ce_timed_bytes / self.ce_seconds / 1e9 if self.ce_seconds > 0 else None
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
        t = self.total[direction]
        engine = None
        if nbytes and seconds > 0:
            if s.sm_bytes and not s.ce_bytes:
                engine = "sm"
            elif s.ce_bytes and not s.sm_bytes:
                engine = "ce"
        for x in (s, t):
            x.seconds += seconds
            x.timed_bytes += nbytes
            x.failed_ops += failed_ops
            if engine == "sm":
                x.sm_seconds += seconds
                x.sm_timed_bytes += nbytes
            elif engine == "ce":
                x.ce_seconds += seconds
                x.ce_timed_bytes += nbytes

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
