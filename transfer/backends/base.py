"""The backend interface: :class:`Backend` and the events and counts it gives back.

A backend moves the bytes of a :class:`~kvtier.transfer.plan.ChunkPlan` between the
pools and gives back events the engine polls. Each backend is a module of
:mod:`kvtier.transfer.backends` (which also holds the registry, :func:`make_backend`);
a backend imports this interface, never the registry.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvtier.fsm import Direction

if TYPE_CHECKING:
    from ..plan import ChunkPlan, FlushPlan, Planner
    from ..pools import DevicePool, HostPool

__all__ = ["TransferEvent", "DoneEvent", "ChunkCounts", "Backend"]


class TransferEvent(Protocol):
    """A point in a transfer stream that the engine polls."""

    def done(self) -> bool:
        """True once everything issued before the event has finished (never blocks).

        Raises whatever the device reported for work before the event (the engine
        turns it into failed completions)."""
        ...

    @property
    def error(self) -> BaseException | None:
        """The failure of the work before this event, once :meth:`done` (fake mode)."""
        ...


class DoneEvent:
    """An event that is complete from the start (synchronous backends).

    Attributes:
        t: ``time.perf_counter()`` at creation (seconds), for timing synchronous work.
    """

    __slots__ = ("_error", "t")

    def __init__(self, error: BaseException | None = None) -> None:
        self._error = error
        self.t = time.perf_counter()

    def done(self) -> bool:
        return True

    @property
    def error(self) -> BaseException | None:
        return self._error


@dataclass(frozen=True, slots=True)
class ChunkCounts:
    """What issuing one chunk cost on the host side.

    Attributes:
        copy_calls: copy API calls made (``copy_``, ``index_copy_``, batched-copy calls).
        kernel_launches: kernel launches.
        thread_blocks: thread blocks of the largest launch (0 without kernels).
        sm_bytes, sm_copies: bytes and contiguous copies (runs x refs) the SM kernel moved
            (``numba`` and ``hybrid`` backends).
        ce_bytes, ce_copies, ce_calls: bytes, copies and driver calls of batched
            copy-engine copies (``hybrid`` backend).
        waits: 1 when this chunk's kernel part waited for a running loadback (``hybrid``).
        stage_bytes, stage_copies, ring_waits: the staging path's bytes, copy-engine
            copies and slots that had to wait for their last use (``hybrid``).
    """

    copy_calls: int = 0
    kernel_launches: int = 0
    thread_blocks: int = 0
    sm_bytes: int = 0
    sm_copies: int = 0
    ce_bytes: int = 0
    ce_copies: int = 0
    ce_calls: int = 0
    waits: int = 0
    stage_bytes: int = 0
    stage_copies: int = 0
    ring_waits: int = 0


class Backend(ABC):
    """Moves bytes; one instance serves one engine (one rank).

    The engine calls :meth:`bind` once, then per flush and direction :meth:`prepare`,
    :meth:`begin`, and :meth:`run_chunk` and :meth:`record` per chunk; :meth:`wait` for
    ``wait_layer``; :meth:`fence` for ``cancel(wait=True)``; :meth:`elapsed` for statistics.
    """

    #: Backend name as accepted by :func:`~kvtier.transfer.backends.make_backend`.
    name: str = "?"
    #: When a flush has both directions: False (default): the engine issues every
    #: chunk of the loadback, then the writeback; True: it prepares both directions,
    #: begins both, then takes them in turn, one chunk each, so that the writeback's
    #: first copy is not behind the loadback's whole issue.
    interleave_directions: bool = False
    host: HostPool
    device: DevicePool
    planner: Planner

    def bind(self, host: HostPool, device: DevicePool, planner: Planner) -> None:
        """Attach the pools; raise :class:`BackendUnavailable` if they do not fit."""
        self.host = host
        self.device = device
        self.planner = planner

    def preflight(self, plans: list[FlushPlan]) -> None:
        """Check a flush before anything is issued (the fake-async backend checks
        hazards here). Default: nothing."""

    def prepare(self, direction: Direction, plan: FlushPlan) -> None:
        """Host-side work for a flush's direction before its start event (the Numba
        backend builds and uploads its table here). Default: nothing."""

    def begin(self, direction: Direction) -> TransferEvent:
        """Order the direction's stream after the compute stream; return a start event."""
        return DoneEvent()

    @abstractmethod
    def run_chunk(self, direction: Direction, plan: FlushPlan, chunk: ChunkPlan,
                  op_ids: tuple[int, ...]) -> ChunkCounts:
        """Issue the chunk's copies on the direction's stream (may return before they run)."""

    def record(self, direction: Direction) -> TransferEvent:
        """An event after everything issued so far on the direction's stream."""
        return DoneEvent()

    def wait(self, event: TransferEvent) -> None:
        """Make the current (compute) stream wait for ``event``."""

    def fence(self, event: TransferEvent) -> None:
        """Block the host until ``event`` is done: the end of copies that cannot be
        cancelled once issued (``TransferEngine.cancel(op, wait=True)``), after which
        their pages may be reused. Default: the event's own ``synchronize()`` if it has
        one (a CUDA event), else poll :meth:`TransferEvent.done` (synchronous backends'
        events are done at once). A failure the event reports is left for the engine's
        next poll, which turns it into failed completions."""
        sync = getattr(event, "synchronize", None)
        try:
            if sync is not None:
                sync()
                return
            while not event.done():
                time.sleep(0.0002)
        except Exception:  # reported by poll_completions, never here
            return

    def elapsed(self, start: TransferEvent, end: TransferEvent) -> float | None:
        """Seconds between two completed events of one stream, if the backend times them."""
        return None

    def synchronize(self) -> None:
        """Block until every issued copy has finished (tests, benchmarks)."""

    def describe(self) -> dict[str, object]:
        """Settings reported in the statistics."""
        return {"name": self.name}
