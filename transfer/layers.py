"""Layer-wise completion: the layer-done counter of one flight.

A *flight* is one direction of one flush. A loadback flight is issued in layer chunks
(one kernel launch per chunk for the Numba backend, so a chunk is the real
granularity) and records one event per chunk. :class:`LayerCounter` polls those events
in order; :class:`OpLayers` maps one operation's layers onto the chunks, so the engine
can report ``Completion(layer=L)`` per chunk and make a stream wait for a layer.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .backends.base import TransferEvent

__all__ = ["LayerCounter", "OpLayers"]


@dataclass(eq=False)
class LayerCounter:
    """Events of one flight's chunks, polled in issue order.

    Attributes:
        events: one event per issued chunk, in order; after a failure the engine
            appends a *barrier* event that completes once everything issued before
            the failure has finished (pages may be reused only after that).
        issued_chunks: chunks issued successfully (events[:issued_chunks] are theirs).
        planned_chunks: chunks the plan has.
        error: the first failure (at issue, or reported by an event), or None.
        done_events: how many events have completed (a prefix).
        ok_limit: after a failure reported by an event, the chunks before it.
    """

    planned_chunks: int
    events: list[TransferEvent] = field(default_factory=list)
    issued_chunks: int = 0
    error: BaseException | None = None
    done_events: int = 0
    ok_limit: int | None = None

    def poll(self) -> None:
        """Advance :attr:`done_events` over completed events (never blocks); an event
        that raises or reports an error records :attr:`error`."""
        while self.done_events < len(self.events):
            ev = self.events[self.done_events]
            try:
                if not ev.done():
                    return
                err = ev.error
            except Exception as e:  # a device error surfaces here: fail, never crash
                err = e
            if err is not None and self.error is None:
                self.error = err
                self.ok_limit = self.done_events  # chunks before this event succeeded
            elif err is not None and self.ok_limit is None:
                self.ok_limit = self.done_events  # a copy failed after a failure at issue
            self.done_events += 1

    @property
    def ok_chunks(self) -> int:
        """Chunks known complete and successful (a prefix of the plan's chunks)."""
        n = min(self.done_events, self.issued_chunks)
        return n if self.ok_limit is None else min(n, self.ok_limit)

    @property
    def finished(self) -> bool:
        """True when nothing of this flight is still running: every event is done and
        either all chunks were issued or a failure stopped issuing."""
        return self.done_events == len(self.events) and (
            self.issued_chunks == self.planned_chunks or self.error is not None)


@dataclass(eq=False)
class OpLayers:
    """One operation's view of a flight.

    Attributes:
        op_id: the operation.
        chunks: per chunk holding any of the op's layers: (chunk index, the op's first
            layer in it, the op's last layer in it), ascending.
        reported: how many of ``chunks`` have been reported as layer completions.
        acked: whether the acknowledgement was sent.
    """

    op_id: int
    chunks: list[tuple[int, int, int]]
    reported: int = 0
    acked: bool = False

    @classmethod
    def build(cls, op_id: int, op_layers: set[int], chunk_layers: list[tuple[int, ...]]) -> OpLayers:
        out = []
        for ci, layers in enumerate(chunk_layers):
            mine = [layer for layer in layers if layer in op_layers]
            if mine:
                out.append((ci, mine[0], mine[-1]))
        return cls(op_id, out)

    def chunk_for(self, layer: int) -> int | None:
        """The chunk that must complete before ``layer`` can be read: the last chunk
        whose first op layer is <= ``layer`` (None if the op has no layer <= it)."""
        i = bisect.bisect_right([c[1] for c in self.chunks], layer)
        return None if i == 0 else self.chunks[i - 1][0]
