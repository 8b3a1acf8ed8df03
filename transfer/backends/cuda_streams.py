"""CUDA streams and events shared by the ``torch`` and ``numba`` backends.

Loadbacks run on a high-priority stream and writebacks on a low-priority one (as in
TokenSpeed; ``spec/README.md``, Sources: TokenSpeed's host transfer path). At the start
of each flush's direction the transfer stream waits for the current (compute) stream,
so a writeback does not read pages the forward pass is still writing, and a loadback
does not overwrite pages that work already queued on the compute stream still uses.
"""

from __future__ import annotations

import torch

from kvtier.fsm import Direction

__all__ = ["CudaEvent", "CudaStreams"]


class CudaEvent:
    """A ``torch.cuda.Event`` recorded on a transfer stream."""

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())  # type: ignore[no-untyped-call]

    def synchronize(self) -> None:
        """Block the host until the event is reached (``Backend.fence``)."""
        self.event.synchronize()

    @property
    def error(self) -> BaseException | None:
        return None


class CudaStreams:
    """The two transfer streams of one device, and event helpers.

    Args:
        device: the CUDA device of the device pool.
        timing: record timing-enabled events (for the statistics' seconds).
    """

    def __init__(self, device: torch.device, timing: bool = True) -> None:
        self.device = device
        self.timing = timing
        lo, hi = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
        # CUDA: lower numbers are higher priorities; priority_range() is (least, greatest)
        high, low = min(lo, hi), max(lo, hi)
        self.streams = {
            Direction.LOADBACK: torch.cuda.Stream(device=device, priority=high),  # type: ignore[no-untyped-call]
            Direction.WRITEBACK: torch.cuda.Stream(device=device, priority=low),  # type: ignore[no-untyped-call]
        }

    def stream(self, direction: Direction) -> torch.cuda.Stream:
        return self.streams[direction]

    def begin(self, direction: Direction) -> CudaEvent:
        """Order the direction's stream after the current stream; return a start event."""
        s = self.streams[direction]
        s.wait_stream(torch.cuda.current_stream(self.device))
        return self.record(direction)

    def record(self, direction: Direction) -> CudaEvent:
        ev = torch.cuda.Event(enable_timing=self.timing)  # type: ignore[no-untyped-call]
        ev.record(self.streams[direction])
        return CudaEvent(ev)

    def wait_on(self, direction: Direction, event: object) -> None:
        """Make the direction's stream wait for a :class:`CudaEvent` (of the other stream)."""
        if isinstance(event, CudaEvent):
            self.streams[direction].wait_event(event.event)

    def wait(self, event: object) -> None:
        """Make the current stream wait for a :class:`CudaEvent`."""
        if isinstance(event, CudaEvent):
            torch.cuda.current_stream(self.device).wait_event(event.event)

    def elapsed(self, start: object, end: object) -> float | None:
        if not self.timing or not isinstance(start, CudaEvent) or not isinstance(end, CudaEvent):
            return None
        return float(start.event.elapsed_time(end.event)) / 1e3

    def synchronize(self) -> None:
        for s in self.streams.values():
            s.synchronize()
