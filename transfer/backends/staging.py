"""The staging path: whole host extents through the copy engines, pages gathered and
scattered on the device (used by the ``hybrid`` backend, :mod:`.hybrid`).

With a page-major host pool (``HostPool(layout="page")``: every layer and component of
a host page contiguous) a run of consecutive host pages is one contiguous byte range.
For a cache group of a flush whose host pages form few such *extents*:

- a **writeback** gathers the flush's device pages of every layer and component into a
  contiguous device staging slot with the copy kernel (device memory only, at HBM
  speed, on at most ``blocks`` SMs), then copies the slot to the host extents with the
  copy engines (one contiguous copy per extent);
- a **loadback** copies the extents into a slot (one copy per extent; a layer chunk of
  the flush is one pitched copy per extent, the chunk's layers of each page) and
  scatters the slot to the device pages with the kernel. A chunk of layers is one
  staged copy and one scatter; its event (what ``wait_layer`` waits for) follows the
  scatter.

The staging memory is a :class:`StagingRing` per direction: ``slots`` device buffers of
``slot_bytes`` each, taken in turn. A slot is reused only after its last use finished:
the copy (or the kernel) of its next use waits on the device for the event of its last
use (back-pressure: flushes keep being issued without blocking the host; the
statistics count such waits as ``ring_waits``). A chunk larger than a slot is cut into
pieces of at most one slot each.

A slot holds the pages of a piece in host order: page ``k`` of a group segment (the
``k``-th host page of the segment in ascending order) at ``segment offset + k * width``,
``width`` = the bytes of the chunk's layers in one host page, so that every extent is
one range on both sides. The kernel's run table for the pieces (runs of one page:
staging page <-> device page; one ref per (layer, component), the staging side's page
stride being ``width``) is built with NumPy and uploaded once per flush.

Under the CUDA simulator (CPU pools) copies are ``memmove`` calls, the kernel the simulator's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.fsm import ConfigError, Direction

from ..plan import REF_COLS, RUN_COLS, ChunkRef, FlushPlan, GroupPlan, I64, Planner
from ..pools import DevicePool, HostPool

__all__ = ["StagingRing", "StagedCopy", "StagePiece", "StagePlan", "host_extents", "plan_staging",
           "DEFAULT_STAGING_BYTES", "DEFAULT_SLOTS", "stageable"]

#: Staging memory (bytes, both directions together) when the host pool is page-major
#: and no size is given: 3 slots of 32 MiB per direction (a probe on the H200 filled the
#: link with 32 MiB slots in a ring of 3, not with 8 MiB ones; bench/RESULTS.md).
DEFAULT_STAGING_BYTES = 192 << 20
#: Slots per direction.
DEFAULT_SLOTS = 3

_ALIGN = 256


class StagingRing:
    """``slots`` slots of ``slot_bytes`` in one buffer, taken in turn (one ring per direction).

    Args:
        slots: number of slots (>= 1).
        slot_bytes: bytes per slot (a positive multiple of 256).

    Raises:
        ConfigError: bad sizes.
    """

    def __init__(self, slots: int, slot_bytes: int) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ConfigError(f"staging ring: slots must be an int >= 1, got {slots!r}")
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes <= 0 or slot_bytes % _ALIGN:
            raise ConfigError(f"staging ring: slot bytes must be a positive multiple of {_ALIGN}, got {slot_bytes!r}")
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._next = 0
        self._busy: list[Any] = [None] * slots  # the event of each slot's last use
        self.waits = 0
        self.uses = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the ring (``slots * slot_bytes``)."""
        return self.slots * self.slot_bytes

    def take(self) -> tuple[int, Any]:
        """The next slot: (its index, the event of its last use or None). When that
        event has not completed, the caller must make its first copy wait for it; this
        counts in :attr:`waits`."""
        j = self._next
        self._next = (j + 1) % self.slots
        ev = self._busy[j]
        self.uses += 1
        if ev is not None and not ev.done():
            self.waits += 1
            return j, ev
        return j, None

    def release(self, slot: int, event: Any) -> None:
        """Record the event after which ``slot`` is free again."""
        self._busy[slot] = event


def host_extents(pages: I64) -> tuple[I64, I64, I64, I64]:
    """(unique host pages ascending, index of each extent's first unique page, extent
    lengths, rank of each of ``pages`` among the unique pages) for int64 ``pages``. One
    pass without a sort when the pages are one range."""
    n = int(pages.shape[0])
    lo, hi = int(pages.min()), int(pages.max())
    if hi - lo + 1 == n:  # one extent (distinct pages; the common case of a writeback)
        return (np.arange(lo, hi + 1, dtype=np.int64), np.zeros(1, dtype=np.int64), np.array([n], dtype=np.int64),
                pages - lo)
    uniq = np.unique(pages)
    rank = np.searchsorted(uniq, pages)
    starts = np.concatenate((np.zeros(1, dtype=np.int64), np.flatnonzero(np.diff(uniq) != 1) + 1))
    lens = np.diff(np.concatenate((starts, np.array([uniq.shape[0]], dtype=np.int64))))
    return uniq, starts, lens, rank


@dataclass(eq=False)
class StagedCopy:
    """One copy-engine copy of a piece: ``rows`` rows of ``width`` bytes between the
    host (byte offset ``host`` from the host pool's base, rows ``pitch`` apart) and the
    slot (offset ``stage`` from the slot's start, rows packed)."""

    host: int
    stage: int
    rows: int
    width: int
    pitch: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.width


@dataclass(eq=False)
class StagePiece:
    """At most one slot of a chunk: copies, and the kernel launch over the piece's part
    of the run table (``ref_word``, ``refs``, ``items``); staging offsets are from the
    start of whichever slot the piece gets (the kernel's staging view starts there)."""

    copies: list[StagedCopy]
    ref_word: int = 0
    refs: int = 0
    items: int = 0

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.copies)


@dataclass(eq=False)
class StagePlan:
    """The staged part of a plan for one direction (cached on the plan).

    Attributes:
        groups: per chunk index, the plan's group indices staged in that chunk.
        pieces: per chunk index, its pieces in issue order.
        packed: int64 run table of every piece (runs, then refs), uploaded once.
        bytes: per chunk index, the device bytes the staged pieces move.
    """

    groups: dict[int, frozenset[int]]
    pieces: dict[int, list[StagePiece]]
    packed: I64
    bytes: dict[int, int] = field(default_factory=dict)
    table: Any = None
    owner: Any = None


def _span(host: HostPool, gp: GroupPlan, refs: list[ChunkRef]) -> tuple[int, int] | None:
    """(first byte within a host page, width) of the refs' bytes in a page, when they
    are one contiguous range of the page; else None."""
    base, stride = host.group_block(gp.group)
    spans = sorted((host.region_offset(r.group, r.component, r.layer) - base, r.page_bytes) for r in refs)
    lo = spans[0][0]
    at = lo
    for off, pb in spans:
        if off != at:
            return None
        at += pb
    width = at - lo
    if lo == 0 and -(-width // 16) * 16 == stride:
        width = stride  # every layer: whole pages, one contiguous copy per extent
    return lo, width


def plan_staging(direction: Direction, plan: FlushPlan, planner: Planner, host: HostPool, device: DevicePool,
                 ring: StagingRing, chosen: dict[int, frozenset[int]], piece_bytes: int) -> StagePlan:
    """Pieces and run table of the groups ``chosen`` per chunk (plan group indices).

    Raises:
        ConfigError: a group that cannot be staged (a width larger than a slot, or a
            chunk's layers not contiguous in a host page): :func:`stageable` says which."""
    slot_bytes = ring.slot_bytes
    loadback = direction is Direction.LOADBACK
    ext_cache: dict[int, tuple[I64, I64, I64, I64]] = {}
    runs_parts: list[I64] = []
    n_runs = 0
    ref_rows: list[list[int]] = []
    pieces: dict[int, list[StagePiece]] = {}
    nbytes: dict[int, int] = {}
    for chunk in plan.chunks:
        gis = chosen.get(chunk.index, frozenset())
        if not gis:
            continue
        out: list[StagePiece] = []
        piece: StagePiece | None = None
        used = 0
        piece_refs: list[list[int]] = []
        items = 0

        def close() -> None:
            nonlocal piece, items
            if piece is not None:
                piece.ref_word = len(ref_rows) * REF_COLS  # relative to the refs part; fixed below
                piece.refs = len(piece_refs)
                piece.items = items
                ref_rows.extend(piece_refs)
                out.append(piece)
            piece = None
            piece_refs.clear()
            items = 0

        for gi in sorted(gis):
            gp = plan.groups[gi]
            refs = [r for r in chunk.refs if r.group_index == gi]
            span = _span(host, gp, refs)
            if span is None:
                raise ConfigError(f"staging: the chunk's layers of cache group {gp.group!r} are not contiguous "
                                  f"in a host page")
            lo, width = span
            if width > slot_bytes:
                raise ConfigError(f"staging: a host page of cache group {gp.group!r} holds {width} bytes of the "
                                  f"chunk, more than a staging slot ({slot_bytes} bytes)")
            gbase, stride = host.group_block(gp.group)
            hp, dp = (gp.src, gp.dst) if loadback else (gp.dst, gp.src)
            if gi not in ext_cache:
                ext_cache[gi] = host_extents(hp)
            uniq, starts, lens, rank = ext_cache[gi]
            total = int(uniq.shape[0])
            a = 0
            while a < total:
                if piece is None:
                    piece = StagePiece([])
                    used = 0
                seg_off = -(-used // 16) * 16
                m = min(total - a, (slot_bytes - seg_off) // width)
                if m <= 0:
                    close()
                    continue
                b = a + m
                # copies: the extents clipped to unique pages [a, b)
                ends = starts + lens
                hit = np.flatnonzero((ends > a) & (starts < b))
                for e in hit.tolist():
                    cs, ce = max(int(starts[e]), a), min(int(ends[e]), b)
                    piece.copies.append(StagedCopy(gbase + int(uniq[cs]) * stride + lo, seg_off + (cs - a) * width,
                                                   ce - cs, width, stride))
                # kernel: one single-page run per plan page of the segment, one ref per (layer, component)
                sel = np.flatnonzero((rank >= a) & (rank < b)) if (a > 0 or b < total) else None
                r_stage = (rank if sel is None else rank[sel]) - a
                r_dev = dp if sel is None else dp[sel]
                k = int(r_stage.shape[0])
                block = np.empty((k, RUN_COLS), dtype=np.int64)
                block[:, 0], block[:, 1] = (r_stage, r_dev) if loadback else (r_dev, r_stage)
                block[:, 2] = 1
                runs_parts.append(block.reshape(-1))
                for r in refs:
                    inpage = host.region_offset(r.group, r.component, r.layer) - gbase - lo
                    dev_off = device.region_offset(r.group, r.component, r.layer)
                    dev_stride = device.page_stride(r.group, r.component, r.layer)
                    ppr = -(-r.page_bytes // piece_bytes)
                    st_off = seg_off + inpage  # relative to the slot: the slot offset is added below
                    row = ([st_off, dev_off, r.page_bytes, n_runs, items, ppr, width, dev_stride] if loadback
                           else [dev_off, st_off, r.page_bytes, n_runs, items, ppr, dev_stride, width])
                    piece_refs.append(row)
                    items += k * ppr
                nbytes[chunk.index] = nbytes.get(chunk.index, 0) + k * sum(r.page_bytes for r in refs)
                n_runs += k
                used = seg_off + m * width
                a = b
        close()
        pieces[chunk.index] = out
    words_runs = RUN_COLS * n_runs
    packed = np.empty(words_runs + REF_COLS * len(ref_rows), dtype=np.int64)
    if runs_parts:
        np.concatenate(runs_parts, out=packed[:words_runs])
    refs_arr = packed[words_runs:].reshape(-1, REF_COLS)
    if ref_rows:
        refs_arr[:] = np.asarray(ref_rows, dtype=np.int64)
    for out in pieces.values():
        for p in out:
            p.ref_word += words_runs
    return StagePlan(dict(chosen), pieces, packed, nbytes)


def stageable(host: HostPool, plan: FlushPlan, chunk_refs: list[ChunkRef], gi: int,
              slot_bytes: int) -> tuple[int, int] | None:
    """(first byte in a host page, width) when group ``gi``'s refs of a chunk can be
    staged (page-major host, the chunk's layers one range of a host page, a page's width
    within one slot), else None."""
    if not host.page_major:
        return None
    span = _span(host, plan.groups[gi], chunk_refs)
    return span if span is not None and span[1] <= slot_bytes else None


def extents_of(direction: Direction, plan: FlushPlan, gi: int) -> tuple[I64, I64, I64, I64]:
    """:func:`host_extents` of group ``gi``'s host pages (cached on the plan)."""
    key = ("stage-extents", gi)
    hit = plan.cache.get(key)
    if hit is None:
        g = plan.groups[gi]
        hit = plan.cache[key] = host_extents(g.src if direction is Direction.LOADBACK else g.dst)
    return hit  # type: ignore[no-any-return]


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
        per_slot = (staging_bytes // 2 // max(1, slots)) // _ALIGN * _ALIGN if isinstance(slots, int) else 0
        self.rings = {d: StagingRing(slots, per_slot) for d in (Direction.LOADBACK, Direction.WRITEBACK)}
        self.b = backend
        self.min_bytes = int(min_bytes)
        self.nbytes = sum(r.nbytes for r in self.rings.values())

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
        """The pieces' run table on the device (once per stage plan)."""
        if sp.table is not None:
            return
        b = self.b
        words = int(sp.packed.shape[0])
        if b.mode == "gpu" and words:
            key = ("stage", direction)
            b._staging(key, words)[:] = sp.packed
            sp.owner, sp.table = b._upload_staged(direction, words, key)
        else:
            sp.owner, sp.table = sp.packed, b._k.device_array(sp.packed)

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

    def issue(self, direction: Direction, sp: StagePlan, chunk_index: int) -> tuple[int, int, int, int]:
        """Issue a chunk's pieces: (bytes, copies, ring waits, kernel launches)."""
        import torch

        from .base import DoneEvent
        from .cuda_streams import CudaEvent

        b = self.b
        ring = self.rings[direction]
        gpu = b.mode == "gpu"
        main = b.streams.stream(direction) if gpu else None
        cs = self.copy_streams[direction] if gpu else None
        handle = int(cs.cuda_stream) if gpu else 0
        nb_stream = b._nb_streams[direction] if gpu else 0
        dev_view = b._views["device"]
        copies = waits = launches = 0
        last: Any = None
        for piece in sp.pieces.get(chunk_index, []):
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
