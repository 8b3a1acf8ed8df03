"""The staging path's issuing side: :class:`Stager` holds a ring, its device buffer and a
copy stream per direction, and issues the pieces that :mod:`.staging` plans (its module
docstring describes the path)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.fsm import Direction

from ..plan import ChunkRef, FlushPlan
from .staging import ALIGN, StagePiece, StagePlan, StagingRing, extents_of, fill_runs, plan_staging, stageable

__all__ = ["Stager"]


class Stager:
    """The staging path of one backend: a ring, its device buffer and a copy stream per
    direction; builds, uploads and issues :class:`StagePlan` pieces (see the module
    docstring). ``backend`` is the :class:`~.numba_sm.NumbaBackend` (hybrid) whose
    kernel, views, streams and copier it uses.

    Args:
        staging_bytes: staging memory of both directions together (bytes); each direction
            gets half, in ``slots`` slots.
        slots: slots per direction.
        min_bytes: a group's pages of a chunk are staged only from this many bytes up.

    Raises:
        ConfigError: a size too small for one 256-byte slot per direction.
    """

    def __init__(self, backend: Any, staging_bytes: int, slots: int, min_bytes: int) -> None:
        per_slot = (staging_bytes // 2 // max(1, slots)) // ALIGN * ALIGN if isinstance(slots, int) else 0
        self.rings = {d: StagingRing(slots, per_slot) for d in (Direction.LOADBACK, Direction.WRITEBACK)}
        self.b = backend
        self.min_bytes = int(min_bytes)
        self.nbytes = sum(r.nbytes for r in self.rings.values())
        self._parity: dict[Direction, int] = {}

    def bind(self) -> None:
        import torch

        b = self.b
        self.buffers = {d: torch.empty(r.nbytes, dtype=torch.uint8, device=b.device.device)
                        for d, r in self.rings.items()}
        self.views: dict[Direction, list[Any]] = {}
        self.copy_streams: dict[Direction, Any] = {}
        for d, r in self.rings.items():
            buf = self.buffers[d]
            sb = r.slot_bytes
            if b.mode == "gpu":
                ptr = int(buf.data_ptr())
                self.views[d] = [b._k.span_arrays(ptr + j * sb, sb, buf) for j in range(r.slots)]
                self.copy_streams[d] = torch.cuda.Stream(device=b.device.device,  # type: ignore[no-untyped-call]
                                                         priority=b.streams.stream(d).priority)
            else:
                u8 = buf.numpy()
                self.views[d] = [b._sim_views(u8[j * sb:(j + 1) * sb]) for j in range(r.slots)]

    # -- choosing -------------------------------------------------------------------------
    def choose(self, direction: Direction, plan: FlushPlan, wins: Any) -> dict[int, frozenset[int]]:
        """Per chunk, the groups to stage: stageable, at least ``min_bytes`` of the
        chunk, and ``wins(mean extent bytes)`` (the calibrated rule)."""
        b = self.b
        out: dict[int, frozenset[int]] = {}
        slot = self.rings[direction].slot_bytes
        for chunk in plan.chunks:
            by_group: dict[int, list[ChunkRef]] = {}
            for r in chunk.refs:
                by_group.setdefault(r.group_index, []).append(r)
            chosen = []
            for gi, refs in by_group.items():
                span = stageable(b.host, plan, refs, gi, slot)
                if span is None:
                    continue
                uniq, starts, _, _ = extents_of(direction, plan, gi)
                staged = int(uniq.shape[0]) * span[1]
                if staged >= self.min_bytes and wins(staged / int(starts.shape[0])):
                    chosen.append(gi)
            if chosen:
                out[chunk.index] = frozenset(chosen)
        return out

    def build(self, direction: Direction, plan: FlushPlan, chosen: dict[int, frozenset[int]]) -> StagePlan:
        b = self.b
        return plan_staging(direction, plan, b.planner, b.host, b.device, self.rings[direction], chosen,
                            b.piece_bytes)

    def upload(self, direction: Direction, sp: StagePlan) -> None:
        """The run table's device copy with its refs (once per stage plan); each
        piece's runs follow when it is issued. On a GPU the host side is a reused pinned
        buffer (two per direction, alternating between flushes)."""
        if sp.table is not None:
            return
        b = self.b
        words = int(sp.packed.shape[0])
        if b.mode != "gpu":
            sp.host, sp.owner, sp.table = sp.packed, sp.packed, b._k.device_array(sp.packed)
            return
        import torch

        self._parity[direction] = parity = 1 - self._parity.get(direction, 0)
        key = ("stage", direction, parity)
        sp.host = b._staging(key, max(words, 1))
        sp.host[sp.refs_word:words] = sp.packed[sp.refs_word:]
        sp.owner = torch.empty(max(words, 1), dtype=torch.int64, device=b.device.device)
        sp.table = b._k.device_array(sp.owner)
        sp.key = key
        self._send(direction, sp, sp.refs_word, words)

    def _send(self, direction: Direction, sp: StagePlan, w0: int, w1: int) -> None:
        """Copy words ``[w0, w1)`` of the pinned table to the device, on the kernel stream."""
        import torch

        if w1 <= w0:
            return
        b = self.b
        main = b.streams.stream(direction)
        with torch.cuda.stream(main):
            sp.owner[w0:w1].copy_(b._stage[sp.key][w0:w1], non_blocking=True)
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(main)
        b._stage_event[sp.key] = ev  # the pinned buffer is written again only after this copy

    # -- issuing --------------------------------------------------------------------------
    def begin(self, direction: Direction) -> None:
        """Order the direction's copy stream after its kernel stream (the flush's start)."""
        if self.b.mode == "gpu":
            self.copy_streams[direction].wait_stream(self.b.streams.stream(direction))

    def _copies(self, direction: Direction, piece: StagePiece, slot_addr: int, stream: int) -> int:
        """Issue a piece's copies; returns the copies made."""
        b = self.b
        host0 = b.host.base_ptr
        one = [c for c in piece.copies if c.width == c.pitch]
        if one:
            h = np.array([host0 + c.host for c in one], dtype=np.uint64)
            s = np.array([slot_addr + c.stage for c in one], dtype=np.uint64)
            n = np.array([c.nbytes for c in one], dtype=np.uint64)
            dst, src = (s, h) if direction is Direction.LOADBACK else (h, s)
            b.copier.copy(direction, dst, src, n, stream)
        for c in piece.copies:
            if c.width != c.pitch:
                if direction is Direction.LOADBACK:
                    b.copier.copy2d(direction, slot_addr + c.stage, c.width, host0 + c.host, c.pitch, c.width, c.rows,
                                    stream)
                else:
                    b.copier.copy2d(direction, host0 + c.host, c.pitch, slot_addr + c.stage, c.width, c.width, c.rows,
                                    stream)
        return len(piece.copies)

    def issue(self, direction: Direction, plan: FlushPlan, sp: StagePlan,
              chunk_index: int) -> tuple[int, int, int, int]:
        """Issue a chunk's pieces: (bytes, copies, ring waits, kernel launches)."""
        import torch

        from .base import DoneEvent
        from .cuda_streams import CudaEvent

        b = self.b
        ring = self.rings[direction]
        gpu = b.mode == "gpu"
        main: Any = b.streams.stream(direction) if gpu else None
        cs: Any = self.copy_streams[direction] if gpu else None
        handle = int(cs.cuda_stream) if gpu else 0
        nb_stream = b._nb_streams[direction] if gpu else 0
        dev_view = b._views["device"]
        copies = waits = launches = 0
        last: Any = None
        for piece in sp.pieces.get(chunk_index, []):
            if not piece.built:  # this piece's runs: built and uploaded now, the earlier pieces already run
                w0, w1 = fill_runs(direction, plan, piece, sp.host)
                if gpu:
                    self._send(direction, sp, w0, w1)
            slot, busy = ring.take()
            waits += busy is not None
            slot_addr = int(self.buffers[direction].data_ptr()) + slot * ring.slot_bytes
            view = self.views[direction][slot]
            grid = b._grid(piece.items)
            if direction is Direction.LOADBACK:
                if gpu and busy is not None:
                    cs.wait_event(busy.event)
                copies += self._copies(direction, piece, slot_addr, handle)
                if gpu:
                    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    ev.record(cs)
                    main.wait_event(ev)
                if piece.items:
                    b._k.launch_runs(view[0], dev_view[0], view[1], dev_view[1], sp.table, sp.table, piece.ref_word,
                                     piece.refs, piece.items, b.piece_bytes, grid, b.threads, nb_stream)
                    launches += 1
                done_on = main
            else:
                if gpu and busy is not None:
                    main.wait_event(busy.event)
                if piece.items:
                    b._k.launch_runs(dev_view[0], view[0], dev_view[1], view[1], sp.table, sp.table, piece.ref_word,
                                     piece.refs, piece.items, b.piece_bytes, grid, b.threads, nb_stream)
                    launches += 1
                if gpu:
                    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    ev.record(main)
                    cs.wait_event(ev)
                copies += self._copies(direction, piece, slot_addr, handle)
                done_on = cs
            if gpu:
                last = torch.cuda.Event()  # type: ignore[no-untyped-call]
                last.record(done_on)
                ring.release(slot, CudaEvent(last))
            else:
                ring.release(slot, DoneEvent())
        if gpu and last is not None and direction is Direction.WRITEBACK:
            main.wait_event(last)  # the chunk's event (recorded on the kernel stream) covers the copies
        return sp.bytes.get(chunk_index, 0), copies, waits, launches

    def synchronize(self) -> None:
        for s in getattr(self, "copy_streams", {}).values():
            s.synchronize()

    def describe(self) -> dict[str, object]:
        r = self.rings[Direction.LOADBACK]
        return {"staging_bytes": self.nbytes, "slots_per_direction": r.slots, "slot_bytes": r.slot_bytes,
                "min_bytes": self.min_bytes, "ring_waits": {d.value: x.waits for d, x in self.rings.items()},
                "ring_uses": {d.value: x.uses for d, x in self.rings.items()}}
