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
stride being ``width``) is built with NumPy and uploaded in one copy per flush and
direction, before the flush's first bulk copy.

Under the CUDA simulator (CPU pools) copies are ``memmove`` calls, the kernel the simulator's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.fsm import ConfigError, Direction

from ..plan import REF_COLS, RUN_COLS, ChunkRef, FlushPlan, GroupPlan, I64, Planner
from ..pools import DevicePool, HostPool

__all__ = ["StagingRing", "StagedCopy", "StagePiece", "StagePlan", "host_extents", "plan_staging", "layout_key",
           "first_pages", "relocate", "ramp_cap", "RAMP",
           "DEFAULT_STAGING_BYTES", "DEFAULT_SLOTS", "stageable", "extents_of", "ALIGN", "fill_runs"]

#: Staging memory (bytes, both directions together) when the host pool is page-major
#: and no size is given: 3 slots of 32 MiB per direction (a probe on the H200 filled the
#: link with 32 MiB slots in a ring of 3, not with 8 MiB ones; bench/RESULTS.md).
DEFAULT_STAGING_BYTES = 192 << 20
#: Slots per direction.
DEFAULT_SLOTS = 3

ALIGN = 256


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
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes <= 0 or slot_bytes % ALIGN:
            raise ConfigError(f"staging ring: slot bytes must be a positive multiple of {ALIGN}, got {slot_bytes!r}")
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


def host_extents(pages: I64, distinct: bool = False) -> tuple[I64, I64, I64, I64]:
    """(unique host pages ascending, index of each extent's first unique page, extent
    lengths, rank of each of ``pages`` among the unique pages) for int64 ``pages``
    (``distinct``: known to hold no page twice). No sort when the pages are one range."""
    n = int(pages.shape[0])
    lo, hi = int(pages.min()), int(pages.max())
    one = hi - lo + 1 == n
    if one and not distinct:
        mark = np.zeros(n, dtype=np.bool_)
        mark[pages - lo] = True
        one = bool(mark.all())
    if one:  # one extent of distinct pages (the common case)
        return (np.arange(lo, hi + 1, dtype=np.int64), np.zeros(1, dtype=np.int64), np.array([n], dtype=np.int64),
                pages - lo)
    uniq = np.unique(pages)
    rank = np.searchsorted(uniq, pages)
    starts = np.concatenate((np.zeros(1, dtype=np.int64), np.flatnonzero(np.diff(uniq) != 1) + 1))
    lens = np.diff(np.concatenate((starts, np.array([uniq.shape[0]], dtype=np.int64)))).astype(np.int64)
    return uniq, starts, lens, rank.astype(np.int64)


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
    #: the plan group index whose pages it copies (-1: not known)
    group: int = -1

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
    #: segments whose runs this piece writes first: (group index, first rank, end rank,
    #: first word, pages); built when the piece is issued (:func:`fill_runs`)
    builds: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    built: bool = False

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.copies)


@dataclass(eq=False)
class StagePlan:
    """The staged part of a plan for one direction (cached on the plan).

    Attributes:
        groups: per chunk index, the plan's group indices staged in that chunk.
        pieces: per chunk index, its pieces in issue order.
        packed: int64 run table of every piece (runs, then refs); the refs are made with
            the plan, the runs filled per flush (:func:`fill_runs`, by ``Stager.upload``).
        bytes: per chunk index, the device bytes the staged pieces move.
    """

    groups: dict[int, frozenset[int]]
    pieces: dict[int, list[StagePiece]]
    packed: I64
    bytes: dict[int, int] = field(default_factory=dict)
    refs_word: int = 0
    table: Any = None
    owner: Any = None
    host: Any = None
    key: Any = None
    #: per plan group index, bytes to add to its copies' host offsets (a reused layout
    #: at another extent, :func:`relocate`)
    moved: dict[int, int] = field(default_factory=dict)


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


_IOTA: list[I64] = [np.arange(0, dtype=np.int64)]


def _iota(n: int) -> I64:
    """A read-only view of ``0..n-1`` (int64), sliced from one array kept and grown to the
    largest ``n`` asked for: a permutation's ranks in host order, without a new array per
    group and flush."""
    if _IOTA[0].shape[0] < n:
        a = np.arange(max(n, 2 * _IOTA[0].shape[0]), dtype=np.int64)
        a.flags.writeable = False
        _IOTA[0] = a
    return _IOTA[0][:n]


def _by_rank(plan: FlushPlan, gi: int, rank: I64, dp: I64, perm: bool) -> tuple[I64, I64]:
    """Group ``gi``'s device pages in host order and their ranks: with ``perm`` (each
    rank once) one scatter, ``dev[rank] = dp`` and ranks ``0..n-1``; else a stable sort.
    Cached on the plan."""
    key = ("stage-order", gi)
    hit = plan.cache.get(key)
    if hit is None:
        if perm:
            dev = np.empty_like(dp)
            dev[rank] = dp
            hit = (dev, _iota(int(dp.shape[0])))
        else:
            order = np.argsort(rank, kind="stable")
            hit = (dp[order], rank[order])
        plan.cache[key] = hit
    return hit


def fill_runs(direction: Direction, plan: FlushPlan, piece: StagePiece, out: I64) -> tuple[int, int]:
    """Write the runs of the segments ``piece`` builds into ``out`` (the plan's table
    words); returns the word range written (empty: ``(0, 0)``)."""
    loadback = direction is Direction.LOADBACK
    lo_w, hi_w = -1, 0
    for gi, a, b, word, k in piece.builds:
        g = plan.groups[gi]
        dp = g.dst if loadback else g.src
        uniq, _, _, rank = extents_of(direction, plan, gi)
        perm = int(uniq.shape[0]) == int(rank.shape[0])
        dev, ranks = _by_rank(plan, gi, rank, dp, perm)
        i0, i1 = (a, b) if perm else (int(np.searchsorted(ranks, a)), int(np.searchsorted(ranks, b)))
        block = out[word:word + RUN_COLS * k].reshape(k, RUN_COLS)
        block[:, 0 if loadback else 1] = _iota(k) if perm else ranks[i0:i1] - a
        block[:, 1 if loadback else 0] = dev[i0:i1]
        block[:, 2] = 1
        lo_w = word if lo_w < 0 else min(lo_w, word)
        hi_w = max(hi_w, word + RUN_COLS * k)
    piece.built = True
    return (lo_w, hi_w) if lo_w >= 0 else (0, 0)


def _group_info(host: HostPool, device: DevicePool, gp: GroupPlan, refs: list[ChunkRef], piece_bytes: int,
                cache: dict[Any, Any] | None) -> tuple[tuple[int, int] | None, int, int, list[tuple[int, int, int, int, int]], int]:
    """(span, host block offset, host page stride, per ref (offset in the span, device
    region offset, device page stride, page bytes, pieces per page), bytes of the refs
    in a page) of a group's refs in a chunk: pool geometry only, so cached by the
    group and its refs' (component, layer) pairs when ``cache`` is given."""
    key = (gp.group, tuple((r.component, r.layer) for r in refs), piece_bytes)
    hit = cache.get(key) if cache is not None else None
    if hit is None:
        span = _span(host, gp, refs)
        gbase, stride = host.group_block(gp.group)
        lo = span[0] if span is not None else 0
        info = [(host.region_offset(r.group, r.component, r.layer) - gbase - lo,
                 device.region_offset(r.group, r.component, r.layer),
                 device.page_stride(r.group, r.component, r.layer), r.page_bytes,
                 -(-r.page_bytes // piece_bytes)) for r in refs]
        hit = (span, gbase, stride, info, sum(r.page_bytes for r in refs))
        if cache is not None:
            cache[key] = hit
    return hit


#: The pipeline ramp (:func:`ramp_cap`): the first pieces of a writeback and the last
#: pieces of a loadback hold ``slot / RAMP**k`` bytes, k = 2, 1.
RAMP = 4


def ramp_cap(index: int, left: int, slot_bytes: int, loadback: bool) -> int:
    """Bytes the next piece of a ramped chunk may hold: a writeback's pieces 0 and 1
    (``index``) hold ``slot/16`` and ``slot/4``, so that its first copy to the host
    starts after a short gather instead of a whole slot's; a loadback chunk's last two
    pieces hold about ``slot/4`` and ``slot/16`` (``left``: the chunk's bytes not yet
    placed, this piece's included), so that its last scatter after its last copy is
    short. Otherwise a whole slot."""
    small, mid = slot_bytes // (RAMP * RAMP), slot_bytes // RAMP
    if not loadback:
        return small if index == 0 else mid if index == 1 else slot_bytes
    if left <= small:
        return left
    if left <= small + mid:
        return left - small
    return min(slot_bytes, left - small - mid)


def plan_staging(direction: Direction, plan: FlushPlan, planner: Planner, host: HostPool, device: DevicePool,
                 ring: StagingRing, chosen: dict[int, frozenset[int]], piece_bytes: int,
                 cache: dict[Any, Any] | None = None, ramp: bool = False) -> StagePlan:
    """Pieces and run table layout of the groups ``chosen`` per chunk (plan group
    indices): copies and refs now, every piece's runs per flush (:func:`fill_runs`, by ``Stager.upload``).
    ``ramp``: the first pieces of a writeback's first staged chunk and the last pieces of
    each of a loadback's chunks are smaller (:func:`ramp_cap`).

    Raises:
        ConfigError: a group that cannot be staged (a width larger than a slot, or a
            chunk's layers not contiguous in a host page): :func:`stageable` says which."""
    slot_bytes = ring.slot_bytes
    loadback = direction is Direction.LOADBACK
    staged_chunks = [c.index for c in plan.chunks if chosen.get(c.index)]
    # a loadback's chunks ramped alike: their pages are cut at the same ranks (the runs are
    # shared) and each chunk's event, after its last scatter, comes sooner
    ramped = set() if not (ramp and staged_chunks) else set(staged_chunks) if loadback else {staged_chunks[0]}
    n_runs = 0
    seg_runs: dict[tuple[int, int, int], tuple[int, int]] = {}
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

        infos = []
        for gi in sorted(gis):
            refs = [r for r in chunk.refs if r.group_index == gi]
            infos.append((gi, _group_info(host, device, plan.groups[gi], refs, piece_bytes, cache)))
        # bytes of the chunk's staged pages, for the ramp (a little low: no alignment gaps)
        left = sum(int(extents_of(direction, plan, gi)[0].shape[0]) * info[0][1]
                   for gi, info in infos if info[0] is not None) if chunk.index in ramped else 0
        placed = 0
        for gi, (span, gbase, stride, ref_info, ref_bytes) in infos:
            gp = plan.groups[gi]
            if span is None:
                raise ConfigError(f"staging: the chunk's layers of cache group {gp.group!r} are not contiguous "
                                  f"in a host page")
            lo, width = span
            if width > slot_bytes:
                raise ConfigError(f"staging: a host page of cache group {gp.group!r} holds {width} bytes of the "
                                  f"chunk, more than a staging slot ({slot_bytes} bytes)")
            uniq, starts, lens, rank = extents_of(direction, plan, gi)
            total = int(uniq.shape[0])
            perm = total == int(rank.shape[0])
            ranks = None if perm else _by_rank(plan, gi, rank, gp.dst if loadback else gp.src, False)[1]
            ends = starts + lens
            a = 0
            while a < total:
                if piece is None:
                    piece = StagePiece([])
                    used = 0
                seg_off = -(-used // 16) * 16
                cap = slot_bytes
                if chunk.index in ramped:
                    cap = ramp_cap(len(out), left - placed + used, slot_bytes, loadback)
                    cap = min(slot_bytes, max(cap, width if used == 0 else 0))  # an empty piece takes a page
                m = min(total - a, (cap - seg_off) // width)
                if m <= 0:
                    close()
                    continue
                placed += m * width
                b = a + m
                # copies: the extents clipped to unique pages [a, b)
                hit = np.flatnonzero((ends > a) & (starts < b))
                for e in hit.tolist():
                    cs, ce = max(int(starts[e]), a), min(int(ends[e]), b)
                    piece.copies.append(StagedCopy(gbase + int(uniq[cs]) * stride + lo, seg_off + (cs - a) * width,
                                                   ce - cs, width, stride, gi))
                # kernel: one single-page run per plan page of the segment, one ref per (layer, component)
                seg = seg_runs.get((gi, a, b))
                if seg is None:  # the same pages in another chunk reuse these runs
                    k = b - a if ranks is None else int(np.searchsorted(ranks, b) - np.searchsorted(ranks, a))
                    piece.builds.append((gi, a, b, RUN_COLS * n_runs, k))
                    seg = seg_runs[(gi, a, b)] = (n_runs, k)
                    n_runs += k
                run0, k = seg
                for inpage, dev_off, dev_stride, pb, ppr in ref_info:
                    st_off = seg_off + inpage  # from the slot's start
                    piece_refs.append([st_off, dev_off, pb, run0, items, ppr, width, dev_stride] if loadback
                                      else [dev_off, st_off, pb, run0, items, ppr, dev_stride, width])
                    items += k * ppr
                nbytes[chunk.index] = nbytes.get(chunk.index, 0) + k * ref_bytes
                used = seg_off + m * width
                a = b
        close()
        pieces[chunk.index] = out
    words_runs = RUN_COLS * n_runs
    packed = np.empty(words_runs + REF_COLS * len(ref_rows), dtype=np.int64)  # runs: filled per flush
    refs_arr = packed[words_runs:].reshape(-1, REF_COLS)
    if ref_rows:
        refs_arr[:] = np.asarray(ref_rows, dtype=np.int64)
    for out in pieces.values():
        for p in out:
            p.ref_word += words_runs
    return StagePlan(dict(chosen), pieces, packed, nbytes, words_runs)


def layout_key(direction: Direction, plan: FlushPlan, chosen: dict[int, frozenset[int]]) -> Any:
    """What the piece layout of :func:`plan_staging` depends on when every chosen group's
    host pages are one extent holding each page once (what kvtier's host allocator
    hands a flush where it can): the chosen groups per chunk and each one's group,
    layers and page count; the extent's first page only moves the copies' host offsets
    (:func:`relocate`). None when some chosen group is not one such extent."""
    sig = []
    for gi in sorted({g for gis in chosen.values() for g in gis}):
        uniq, starts, _, rank = extents_of(direction, plan, gi)
        if int(starts.shape[0]) != 1 or int(uniq.shape[0]) != int(rank.shape[0]):
            return None
        g = plan.groups[gi]
        sig.append((gi, g.group, g.layers, int(uniq.shape[0])))
    return (direction, tuple(sorted((c, tuple(sorted(g))) for c, g in chosen.items())), tuple(sig))


def first_pages(direction: Direction, plan: FlushPlan, chosen: dict[int, frozenset[int]]) -> dict[int, int]:
    """Per chosen group, its first (lowest) host page."""
    return {gi: int(extents_of(direction, plan, gi)[0][0]) for gis in chosen.values() for gi in gis}


def relocate(template: StagePlan, moved: dict[int, int]) -> StagePlan:
    """``template`` (a :func:`plan_staging` result) at other host extents: its copies'
    host offsets move by ``moved[group index]`` bytes (:attr:`StagePlan.moved`, applied
    when the copies are issued), O(1): the pieces, their copies and the run table's
    array are shared with the template. Sharing the array is safe: on a GPU only its
    refs part is read (into the flush's own pinned table); under the simulator the
    runs are filled and read within one flush (the kernel runs when it is launched)."""
    both = {gi: template.moved.get(gi, 0) + moved.get(gi, 0) for gi in set(template.moved) | set(moved)}
    return StagePlan(template.groups, template.pieces, template.packed, template.bytes, template.refs_word,
                     moved=both)


def stageable(host: HostPool, plan: FlushPlan, chunk_refs: list[ChunkRef], gi: int,
              slot_bytes: int, cache: dict[Any, Any] | None = None) -> tuple[int, int] | None:
    """(first byte in a host page, width) when group ``gi``'s refs of a chunk can be
    staged (page-major host, the chunk's layers one range of a host page, a page's width
    within one slot), else None (``cache``: as :func:`plan_staging`'s)."""
    if not host.page_major:
        return None
    gp = plan.groups[gi]
    key = ("span", gp.group, tuple((r.component, r.layer) for r in chunk_refs))
    if cache is not None and key in cache:
        span = cache[key]
    else:
        span = _span(host, gp, chunk_refs)
        if cache is not None:
            cache[key] = span
    return span if span is not None and span[1] <= slot_bytes else None


def extents_of(direction: Direction, plan: FlushPlan, gi: int) -> tuple[I64, I64, I64, I64]:
    """:func:`host_extents` of group ``gi``'s host pages (cached on the plan)."""
    key = ("stage-extents", gi)
    hit = plan.cache.get(key)
    if hit is None:
        g = plan.groups[gi]
        # a writeback's host pages are destinations: the planner leaves none twice
        hit = plan.cache[key] = host_extents(g.src if direction is Direction.LOADBACK else g.dst,
                                             direction is Direction.WRITEBACK)
    return hit
