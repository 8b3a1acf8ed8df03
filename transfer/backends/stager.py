"""The staging path's issuing side: :class:`Stager` holds a ring, its device buffer and a
copy stream per direction, and issues the pieces that :mod:`.staging` plans (its module
docstring describes the path)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.fsm import Direction

from ..plan import ChunkRef, FlushPlan
from .staging import (ALIGN, StagePiece, StagePlan, StagingRing, extents_of, fill_runs, first_pages, layout_key,
                      plan_staging, relocate, stageable)

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
        host_tables: on a GPU, the gather/scatter kernels read the run table from the
            reused pinned buffer it is written into (mapped host memory) instead of a
            device copy of it (default False): no table copy before the flush's first
            bulk copy.
        ramp: smaller first pieces of a writeback and last pieces of each loadback
            chunk (:func:`.staging.ramp_cap`: the gather before the first copy to the
            host and the scatter after a chunk's last copy from it are short; default
            False: no gain measured on the H200 with 32 MiB slots, bench/RESULTS.md).

    Raises:
        ConfigError: a size too small for one 256-byte slot per direction.
    """

    def __init__(self, backend: Any, staging_bytes: int, slots: int, min_bytes: int,
                 host_tables: bool = False, ramp: bool = False) -> None:
        per_slot = (staging_bytes // 2 // max(1, slots)) // ALIGN * ALIGN if isinstance(slots, int) else 0
        self.rings = {d: StagingRing(slots, per_slot) for d in (Direction.LOADBACK, Direction.WRITEBACK)}
        self.ramp = bool(ramp)
        self.b = backend
        self.min_bytes = int(min_bytes)
        self.host_tables = bool(host_tables)
        self._host_views: dict[Any, tuple[int, int, Any]] = {}
        self._templates: dict[Any, Any] = {}
        self.layout_reuses = 0  # piece layouts of one-extent flushes (staging.plan_staging)
        self.nbytes = sum(r.nbytes for r in self.rings.values())
        self._parity: dict[Direction, int] = {}
        self._geometry: dict[Any, Any] = {}  # pool geometry of a group's refs in a chunk (staging._group_info)

    def bind(self) -> None:
        import torch

        b = self.b
        self.buffers = {d: torch.empty(r.nbytes, dtype=torch.uint8, device=b.device.device)
                        for d, r in self.rings.items()}
        self.views: dict[Direction, list[Any]] = {}
        self.copy_streams: dict[Direction, Any] = {}
        self._ready: dict[Direction, list[Any]] = {}
        self._free: dict[Direction, list[Any]] = {}
        self._sent: dict[Any, Any] = {}
        self._tables: dict[Any, tuple[Any, Any]] = {}
        self._start: dict[Direction, Any] = {}
        for d, r in self.rings.items():
            buf = self.buffers[d]
            sb = r.slot_bytes
            if b.mode == "gpu":
                from .driver import RawEvent, driver

                self.drv = driver()
                ptr = int(buf.data_ptr())
                self.views[d] = [b._k.span_arrays(ptr + j * sb, sb, buf) for j in range(r.slots)]
                self.copy_streams[d] = torch.cuda.Stream(device=b.device.device,  # type: ignore[no-untyped-call]
                                                         priority=b.streams.stream(d).priority)
                # per slot: the hand-over between the kernel and copy streams, and its last use
                self._ready[d] = [RawEvent(self.drv) for _ in range(r.slots)]
                self._free[d] = [RawEvent(self.drv) for _ in range(r.slots)]
                self._start[d] = RawEvent(self.drv)
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
        if len(self._geometry) > 4096:  # bounded: layer subsets are the commands' choice
            self._geometry.clear()
        for chunk in plan.chunks:
            by_group: dict[int, list[ChunkRef]] = {}
            for r in chunk.refs:
                by_group.setdefault(r.group_index, []).append(r)
            chosen = []
            for gi, refs in by_group.items():
                span = stageable(b.host, plan, refs, gi, slot, self._geometry)
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
        """The stage plan of ``chosen`` (:func:`.staging.plan_staging`). When every chosen
        group's host pages are one extent (:func:`.staging.layout_key`), the piece layout
        of an earlier flush of the same shape is reused, its copies moved to this flush's
        extents (:func:`.staging.relocate`): O(1) instead of the layout's Python loops
        (``layout_reuses`` in the statistics)."""
        b = self.b
        key = layout_key(direction, plan, chosen)
        if key is not None:
            hit = self._templates.get(key)
            if hit is not None:
                tmpl, pages0 = hit
                now = first_pages(direction, plan, chosen)
                moved = {gi: (now[gi] - pages0[gi]) * b.host.group_block(plan.groups[gi].group)[1] for gi in now}
                self.layout_reuses += 1
                return relocate(tmpl, moved)
        sp = plan_staging(direction, plan, b.planner, b.host, b.device, self.rings[direction], chosen,
                          b.piece_bytes, self._geometry, self.ramp)
        if key is not None:
            if len(self._templates) >= 64:  # bounded: flush shapes are the callers' choice
                self._templates.clear()
            self._templates[key] = (relocate(sp, {}), first_pages(direction, plan, chosen))
        return sp

    def upload(self, direction: Direction, plan: FlushPlan, sp: StagePlan) -> None:
        """The whole run table of the stage plan (its refs and every piece's runs) on
        the device, in one copy on the kernel stream, before the flush's first copy.

        On a GPU it is written into a reused pinned buffer and copied into a reused
        device buffer (two of each per direction, alternating between flushes, grown by
        doubling), every flush, also for a cached plan. In one copy and up front because
        copies from the host are served in issue order: a writeback's table copied
        behind the loadback's bulk copies of the same flush waited for them (the H200
        run of bench/RESULTS.md, "Staging path: issue cost and both directions")."""
        b = self.b
        words = int(sp.packed.shape[0])
        pieces = [p for ps in sp.pieces.values() for p in ps]
        if b.mode != "gpu":
            if sp.table is None:
                sp.host, sp.owner, sp.table = sp.packed, sp.packed, b._k.device_array(sp.packed)
            for piece in pieces:
                fill_runs(direction, plan, piece, sp.packed)
            return
        import torch

        self._parity[direction] = parity = 1 - self._parity.get(direction, 0)
        key = ("stage", direction, parity)
        host = b._staging(key, max(words, 1))  # waits for the last kernel that read it (two flushes ago)
        host[sp.refs_word:words] = sp.packed[sp.refs_word:]
        for piece in pieces:
            fill_runs(direction, plan, piece, host)
        main = b.streams.stream(direction)
        if self.host_tables:  # the kernels read the table from the pinned buffer itself: no copy
            buf = b._stage[key]  # the whole pinned tensor (the view stays valid until it grows)
            ptr = int(buf.data_ptr())
            hv = self._host_views.get(key)
            if hv is None or hv[0] != ptr:
                n = int(buf.numel())
                hv = self._host_views[key] = (ptr, n, b._k.span_array_i64(ptr, 8 * n, buf))
            sp.host, sp.owner, sp.table, sp.key = host, host, hv[2], key
            self._last_use(direction, key)
            return
        dev = self._tables.get(key)
        if dev is None or int(dev[0].numel()) < words:
            with torch.cuda.stream(main):  # freed memory is reused in this stream's order
                t = torch.empty(max(words, 1 << 16, 2 * int(dev[0].numel()) if dev is not None else 0),
                                dtype=torch.int64, device=b.device.device)
            dev = self._tables[key] = (t, b._k.device_array(t))
        sp.host, sp.owner, sp.table, sp.key = host, dev[0], dev[1], key
        h = int(main.cuda_stream)
        self.drv.copy(int(dev[0].data_ptr()), int(host.ctypes.data), 8 * words, h)
        self._last_use(direction, key)

    def _last_use(self, direction: Direction, key: Any) -> None:
        """Record, on the kernel stream, the point after which the tables ``key`` may be
        written again (after this flush's last kernel of the direction when issued
        behind it); :meth:`NumbaBackend._staging` waits for it."""
        ev = self._sent.get(key)
        if ev is None:
            from .driver import RawEvent

            ev = self._sent[key] = RawEvent(self.drv)
        self.drv.record(ev, int(self.b.streams.stream(direction).cuda_stream))
        self.b._stage_event[key] = ev

    # -- issuing --------------------------------------------------------------------------
    def begin(self, direction: Direction) -> None:
        """Order the direction's copy stream after its kernel stream (the flush's start)."""
        if self.b.mode == "gpu":
            ev = self._start[direction]
            self.drv.record(ev, int(self.b.streams.stream(direction).cuda_stream))
            self.drv.wait(int(self.copy_streams[direction].cuda_stream), ev)

    def _copies(self, direction: Direction, piece: StagePiece, slot_addr: int, stream: int,
                moved: dict[int, int]) -> int:
        """Issue a piece's copies (host offsets moved by ``moved[group index]`` bytes,
        :attr:`.staging.StagePlan.moved`); returns the copies made."""
        b = self.b
        host0 = b.host.base_ptr
        loadback = direction is Direction.LOADBACK
        gpu = b.mode == "gpu"
        one = [c for c in piece.copies if c.width == c.pitch]
        if gpu and len(one) <= 4:  # a few contiguous extents: one plain copy each
            for c in one:
                ha, sa = host0 + c.host + moved.get(c.group, 0), slot_addr + c.stage
                self.drv.copy(sa if loadback else ha, ha if loadback else sa, c.nbytes, stream)
        elif one:
            h = np.array([host0 + c.host + moved.get(c.group, 0) for c in one], dtype=np.uint64)
            s = np.array([slot_addr + c.stage for c in one], dtype=np.uint64)
            n = np.array([c.nbytes for c in one], dtype=np.uint64)
            dst, src = (s, h) if loadback else (h, s)
            b.copier.copy(direction, dst, src, n, stream)
        for c in piece.copies:
            if c.width != c.pitch:
                ha = host0 + c.host + moved.get(c.group, 0)
                if loadback:
                    b.copier.copy2d(direction, slot_addr + c.stage, c.width, ha, c.pitch, c.width, c.rows, stream)
                else:
                    b.copier.copy2d(direction, ha, c.pitch, slot_addr + c.stage, c.width, c.width, c.rows, stream)
        return len(piece.copies)

    def issue(self, direction: Direction, plan: FlushPlan, sp: StagePlan,
              chunk_index: int) -> tuple[int, int, int, int]:
        """Issue a chunk's pieces: (bytes, copies, ring waits, kernel launches)."""
        if self.b.mode == "gpu":
            return self._issue_gpu(direction, plan, sp, chunk_index)
        from .base import DoneEvent

        b = self.b
        ring = self.rings[direction]
        dev_view = b._views["device"]
        copies = waits = launches = 0
        for piece in sp.pieces.get(chunk_index, []):
            slot, busy = ring.take()
            waits += busy is not None
            slot_addr = int(self.buffers[direction].data_ptr()) + slot * ring.slot_bytes
            view = self.views[direction][slot]
            grid = b._grid(piece.items)
            if direction is Direction.LOADBACK:
                copies += self._copies(direction, piece, slot_addr, 0, sp.moved)
                if piece.items:
                    b._k.launch_runs(view[0], dev_view[0], view[1], dev_view[1], sp.table, sp.table, piece.ref_word,
                                     piece.refs, piece.items, b.piece_bytes, grid, b.threads, 0)
                    launches += 1
            else:
                if piece.items:
                    b._k.launch_runs(dev_view[0], view[0], dev_view[1], view[1], sp.table, sp.table, piece.ref_word,
                                     piece.refs, piece.items, b.piece_bytes, grid, b.threads, 0)
                    launches += 1
                copies += self._copies(direction, piece, slot_addr, 0, sp.moved)
            ring.release(slot, DoneEvent())
        return sp.bytes.get(chunk_index, 0), copies, waits, launches

    def _issue_gpu(self, direction: Direction, plan: FlushPlan, sp: StagePlan,
                   chunk_index: int) -> tuple[int, int, int, int]:
        """:meth:`issue` on a GPU: raw driver calls only (:mod:`.driver`): per piece at
        most one launch, its copies and three event records or waits, all on pre-made
        events (the run table went out in :meth:`upload`)."""
        b = self.b
        drv = self.drv
        ring = self.rings[direction]
        main = int(b.streams.stream(direction).cuda_stream)
        cs = int(self.copy_streams[direction].cuda_stream)
        ready, free = self._ready[direction], self._free[direction]
        base = int(self.buffers[direction].data_ptr())
        dev_view = b._views["device"]
        launch = b._launcher
        loadback = direction is Direction.LOADBACK
        copies = waits = launches = 0
        last = -1
        for piece in sp.pieces.get(chunk_index, []):
            slot, busy = ring.take()
            if busy is not None:
                waits += 1
                drv.wait(cs if loadback else main, busy)
            slot_addr = base + slot * ring.slot_bytes
            view = self.views[direction][slot]
            grid = b._grid(piece.items)
            if loadback:
                copies += self._copies(direction, piece, slot_addr, cs, sp.moved)
                drv.record(ready[slot], cs)
                drv.wait(main, ready[slot])
                if piece.items:
                    launch(view[0], dev_view[0], view[1], dev_view[1], sp.table, sp.table, piece.ref_word,
                           piece.refs, piece.items, b.piece_bytes, grid, b.threads, main)
                    launches += 1
                drv.record(free[slot], main)
            else:
                if piece.items:
                    launch(dev_view[0], view[0], dev_view[1], view[1], sp.table, sp.table, piece.ref_word,
                           piece.refs, piece.items, b.piece_bytes, grid, b.threads, main)
                    launches += 1
                drv.record(ready[slot], main)
                drv.wait(cs, ready[slot])
                copies += self._copies(direction, piece, slot_addr, cs, sp.moved)
                drv.record(free[slot], cs)
            ring.release(slot, free[slot])
            last = slot
        if last >= 0 and not loadback:
            drv.wait(main, free[last])  # the chunk's event (recorded on the kernel stream) covers the copies
        if last >= 0 and sp.key is not None:
            self._last_use(direction, sp.key)
        return sp.bytes.get(chunk_index, 0), copies, waits, launches

    def synchronize(self) -> None:
        for s in getattr(self, "copy_streams", {}).values():
            s.synchronize()

    def describe(self) -> dict[str, object]:
        r = self.rings[Direction.LOADBACK]
        return {"staging_bytes": self.nbytes, "slots_per_direction": r.slots, "slot_bytes": r.slot_bytes,
                "min_bytes": self.min_bytes, "host_tables": self.host_tables, "ramp": self.ramp,
                "layout_reuses": self.layout_reuses, "ring_waits": {d.value: x.waits for d, x in self.rings.items()},
                "ring_uses": {d.value: x.uses for d, x in self.rings.items()}}
