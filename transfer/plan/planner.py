"""The :class:`Planner`: coalesces a flush's commands into a :class:`FlushPlan`, cuts it
into layer chunks and builds its copy tables, with caches (see :mod:`kvtier.transfer.plan`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.fsm import CacheGroupSpec, ConfigError, Direction, GroupTransfer, UsageError

from ..arrays import PageArrays
from ..pools import DevicePool, HostPool
from .records import I64, ChunkPlan, ChunkRef, Command, FlushPlan, GroupPlan, layers_for
from .tables import (
    DEFAULT_PIECE_BYTES,
    MAX_CHUNK_ITEMS,
    REF_COLS,
    REF_DST,
    REF_ITEM0,
    REF_PAGE_BYTES,
    REF_PIECES,
    REF_RUN0,
    REF_SRC,
    REF_SRC_STRIDE,
    REF_DST_STRIDE,
    RUN_COLS,
    RunTable,
    split_rows,
    split_runs,
)

__all__ = ["Planner"]


_NEXT_PAIR = (1 << 32) + 1  # (src + 1, dst + 1) packed as in Planner._build


def _runs(src: I64, dst: I64, pair: I64 | None = None) -> tuple[I64, I64, I64]:
    """Contiguous runs of unique pairs, in their order (``pair``: the same pairs packed as
    ``src << 32 | dst``, if at hand: one difference instead of two)."""
    n = src.shape[0]
    if n == 0:
        e = np.zeros(0, dtype=np.int64)
        return e, e, e
    if pair is None:
        brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    else:
        brk = np.flatnonzero(np.diff(pair) != _NEXT_PAIR) + 1
    if brk.shape[0] == n - 1:  # no two pairs contiguous (scattered pages): no gathers
        return src, dst, np.ones(n, dtype=np.int64)
    starts = np.concatenate((np.zeros(1, dtype=np.int64), brk))
    ends = np.concatenate((brk, np.array([n], dtype=np.int64)))
    return src[starts], dst[starts], ends - starts


class Planner:
    """Builds :class:`FlushPlan` objects for one pair of pools, with caches.

    Args:
        specs: the cache groups (same as the pools').
        host, device: the pools.
        chunk_layers: model layers per loadback chunk (default 4).
        plan_cache_size: whole plans kept (LRU; 0 disables).
    """

    def __init__(self, specs: Sequence[CacheGroupSpec], host: HostPool, device: DevicePool, *,
                 chunk_layers: int = 4, plan_cache_size: int = 16) -> None:
        if isinstance(chunk_layers, bool) or not isinstance(chunk_layers, int) or chunk_layers <= 0:
            raise ConfigError(f"chunk_layers must be a positive int, got {chunk_layers!r}")
        if isinstance(plan_cache_size, bool) or not isinstance(plan_cache_size, int) or plan_cache_size < 0:
            raise ConfigError(f"plan_cache_size must be an int >= 0, got {plan_cache_size!r}")
        self.specs = {s.name: s for s in specs}
        self.host = host
        self.device = device
        self.chunk_layers = chunk_layers
        self.plan_cache_size = plan_cache_size
        self._arrays: OrderedDict[int, tuple[GroupTransfer, I64, I64]] = OrderedDict()
        self._plans: OrderedDict[tuple[Any, ...], tuple[tuple[Any, ...], FlushPlan]] = OrderedDict()
        self._addr: dict[tuple[Direction, str, tuple[tuple[str, int], ...]], tuple[I64, I64, I64, I64, I64]] = {}
        self._unit: dict[str, bool] = {}
        self._mark: dict[tuple[int, str], npt.NDArray[np.int32]] = {}
        self._iota = np.arange(1024, dtype=np.int32)
        self._one = np.ones(0, dtype=np.int64)
        self._chunk_layouts: dict[Any, Any] = {}
        # pages of the commands queued for the next flush (Planner.queue): per
        # (direction, side, group) a mark per pool page, and what set them
        self._qmark: dict[tuple[Direction, str, str], npt.NDArray[np.bool_]] = {}
        self._qtouched: dict[Direction, list[tuple[str, str, I64]]] = {}
        self.counters = {"plan_hits": 0, "plan_misses": 0, "address_hits": 0, "address_misses": 0}

    # -- conversions --------------------------------------------------------------------
    def arrays(self, transfer: GroupTransfer | PageArrays) -> tuple[I64, I64]:
        """(src, dst) page ids of a transfer as int64 arrays (a :class:`PageArrays`'
        own arrays; a :class:`GroupTransfer`'s tuples converted, cached by identity)."""
        if isinstance(transfer, PageArrays):
            return transfer.src_pages, transfer.dst_pages
        hit = self._arrays.get(id(transfer))
        if hit is not None and hit[0] is transfer:
            self._arrays.move_to_end(id(transfer))
            return hit[1], hit[2]
        n = len(transfer.src_pages)
        src = np.fromiter(transfer.src_pages, dtype=np.int64, count=n)  # faster than np.array on tuples
        dst = np.fromiter(transfer.dst_pages, dtype=np.int64, count=n)
        self._arrays[id(transfer)] = (transfer, src, dst)
        if len(self._arrays) > 4096:
            self._arrays.popitem(last=False)
        return src, dst

    def clear(self) -> None:
        """Drop every cache (address tables, plans, converted page lists)."""
        self._arrays.clear()
        self._plans.clear()
        self._addr.clear()

    # -- checks -------------------------------------------------------------------------
    def _pages_of(self, command: Command) -> list[tuple[str, I64, I64]]:
        """(group, device pages, host pages) of each transfer of ``command`` with pages."""
        load = command.direction is Direction.LOADBACK
        out = []
        for t in command.transfers:
            if len(t.src_pages):
                s, d = self.arrays(t)
                out.append((t.group, d if load else s, s if load else d))
        return out

    def _marks(self, direction: Direction, side: str, group: str) -> npt.NDArray[np.bool_]:
        key = (direction, side, group)
        mark = self._qmark.get(key)
        if mark is None:
            pool = self.device if side == "device" else self.host
            mark = self._qmark[key] = np.zeros(pool.pages(group), dtype=np.bool_)
        return mark

    def queue(self, command: Command) -> None:
        """Record the pages of a command queued for the next flush (what
        :meth:`check_same_pages` compares the other direction's commands with): one
        scatter per page array, O(pages)."""
        touched = self._qtouched.setdefault(command.direction, [])
        for group, dev, host in self._pages_of(command):
            for side, pages in (("device", dev), ("host", host)):
                self._marks(command.direction, side, group)[pages] = True
                touched.append((side, group, pages))

    def unqueue(self, direction: Direction, remaining: Sequence[Command] = ()) -> None:
        """Forget the queued pages of ``direction`` (its queue was flushed, or a command
        was taken out of it: then ``remaining`` are the commands still queued)."""
        for side, group, pages in self._qtouched.pop(direction, []):
            self._marks(direction, side, group)[pages] = False
        for c in remaining:
            self.queue(c)

    def check_same_pages(self, command: Command, others: Sequence[Command]) -> None:
        """Refuse ``command`` when it and a command of the other direction queued for the
        same flush touch one page that either writes: a device page a loadback writes
        and a writeback reads, or a host page a writeback writes and a loadback reads.
        Loadbacks and writebacks run on two unordered streams, so the read would see the
        page before or after the write, by chance.

        ``others`` are the other direction's queued commands, each recorded with
        :meth:`queue`: the check reads their running page marks (one gather per page
        array, O(pages of ``command``), whatever the queue's length); ``others`` is
        searched only to name the op of a refused command.

        Raises:
            UsageError: naming the page, its side and cache group, and both op ids.
        """
        if not others:
            return
        mine_load = command.direction is Direction.LOADBACK
        other_dir = Direction.WRITEBACK if mine_load else Direction.LOADBACK
        for group, dev, host in self._pages_of(command):
            for side, mine in (("device", dev), ("host", host)):
                mark = self._qmark.get((other_dir, side, group))
                if mark is None:
                    continue
                hit = mark[mine]
                if not hit.any():
                    continue
                page = int(mine[int(np.argmax(hit))])
                op = next((o.op_id for o in others for g, od, oh in self._pages_of(o)
                           if g == group and np.any((od if side == "device" else oh) == page)), -1)
                writes = (side == "device") == mine_load
                load, wb = (command.op_id, op) if mine_load else (op, command.op_id)
                raise UsageError(
                    f"op {command.op_id}: {side} page {page} of cache group {group!r} is "
                    f"{'written' if writes else 'read'} by it and {'read' if writes else 'written'} by op {op} "
                    f"queued for the same flush (loadback {load}, writeback {wb}): the loadback and "
                    f"writeback streams are unordered; flush one before submitting the other")

    # -- planning -----------------------------------------------------------------------
    def plan(self, direction: Direction, commands: Sequence[Command]) -> FlushPlan:
        """Merge ``commands`` (all of ``direction``, already validated) into a plan."""
        ident = tuple((c.layers, tuple(c.transfers)) for c in commands)
        key = (direction, tuple((c.layers, tuple(id(t) for t in c.transfers)) for c in commands))
        if self.plan_cache_size:
            hit = self._plans.get(key)
            if hit is not None and all(
                    a[0] == b[0] and all(x is y for x, y in zip(a[1], b[1]))
                    for a, b in zip(hit[0], ident)):
                self._plans.move_to_end(key)
                self.counters["plan_hits"] += 1
                return hit[1]
        self.counters["plan_misses"] += 1
        plan = self._build(direction, commands, set())
        if plan.rejected:
            plan = self._build(direction, commands, set(plan.rejected), plan.rejected)
        if self.plan_cache_size:
            self._plans[key] = (ident, plan)
            if len(self._plans) > self.plan_cache_size:
                self._plans.popitem(last=False)
        return plan

    def _build(self, direction: Direction, commands: Sequence[Command], skip: set[int],
               rejected: dict[int, str] | None = None) -> FlushPlan:
        parts: dict[tuple[str, tuple[int, ...]], list[tuple[int, I64, I64]]] = {}
        for ci, cmd in enumerate(commands):
            if ci in skip:
                continue
            for t in cmd.transfers:
                if len(t.src_pages) == 0:
                    continue
                layers = layers_for(cmd, self.specs[t.group])
                s, d = self.arrays(t)
                parts.setdefault((t.group, layers), []).append((ci, s, d))
        found: dict[int, str] = {}
        groups: list[GroupPlan] = []
        dst_pool = self.device if direction is Direction.LOADBACK else self.host
        for (g, layers), items in parts.items():
            if len(items) == 1:
                src, dst = items[0][1], items[0][2]
            else:
                src = np.concatenate([s for _, s, _ in items])
                dst = np.concatenate([d for _, _, d in items])
            if self._distinct(dst_pool, g, dst):  # the common case: no sort, runs in the given order
                # a page-major host's pages are copied one by one (unit_runs): no run detection
                rs, rd, rl = (src, dst, self._ones(src.shape[0])) if self.unit_runs(g) else _runs(src, dst)
                groups.append(GroupPlan(g, layers, src, dst, rs, rd, rl))
                continue
            pair = src << 32  # page ids < 2**31 (pool sizes); a fresh array, sorted in place:
            pair |= dst  # sort + neighbour mask is much faster than np.unique
            pair.sort()
            if pair.shape[0] > 1:
                new = pair[1:] != pair[:-1]
                if not new.all():
                    pair = pair[np.concatenate((np.ones(1, dtype=bool), new))]
            us = pair >> 32
            ud = pair & 0xFFFFFFFF
            sd = np.sort(ud)
            dup = sd[1:] == sd[:-1]
            if dup.any():
                bad = np.unique(sd[1:][dup])
                for ci, _, d in items:
                    hit = np.intersect1d(d, bad)
                    if hit.size:
                        found.setdefault(ci, f"destination page {int(hit[0])} of cache group {g!r} is also "
                                             f"written from another source page in the same flush")
                continue
            rs, rd, rl = (us, ud, self._ones(us.shape[0])) if self.unit_runs(g) else _runs(us, ud, pair)
            groups.append(GroupPlan(g, layers, us, ud, rs, rd, rl))
        if found and rejected is None:
            return FlushPlan(direction, (), (), found)
        chunks = self._chunks(direction, groups)
        return FlushPlan(direction, tuple(groups), chunks, dict(rejected or {}))

    def _distinct(self, pool: HostPool | DevicePool, group: str, dst: I64) -> bool:
        """True when no page id repeats in ``dst`` (ids of ``group`` in ``pool``): one
        scatter and one gather into a scratch array of the pool's page count, O(n)
        with no sort (last writer wins, so a repeated id reads back another index)."""
        n = int(dst.shape[0])
        if n < 2:
            return True
        key = (id(pool), group)
        mark = self._mark.get(key)
        if mark is None:
            mark = np.empty(pool.pages(group), dtype=np.int32)
            self._mark[key] = mark
        if self._iota.shape[0] < n:
            self._iota = np.arange(max(n, 2 * self._iota.shape[0]), dtype=np.int32)
        idx = self._iota[:n]
        mark[dst] = idx
        return bool(np.array_equal(mark[dst], idx))

    def _ones(self, n: int) -> I64:
        """A read-only int64 array of ``n`` ones (run lengths of single pages; shared)."""
        if self._one.shape[0] < n:
            self._one = np.ones(max(n, 2 * self._one.shape[0]), dtype=np.int64)
            self._one.flags.writeable = False
        return self._one[:n]

    def _chunks(self, direction: Direction, groups: list[GroupPlan]) -> tuple[ChunkPlan, ...]:
        """The plan's layer chunks. Their layers and refs depend only on the direction and
        each group's (name, layers): that layout is cached (bounded), the counts are
        made from the groups' pages and spans."""
        key = (direction, tuple((g.group, g.layers) for g in groups))
        layout = self._chunk_layouts.get(key)
        if layout is None:
            layout = self._chunk_layout(direction, groups)
            if len(self._chunk_layouts) >= 256:  # bounded: group and layer sets are the commands' choice
                self._chunk_layouts.clear()
            self._chunk_layouts[key] = layout
        chunks: list[ChunkPlan] = []
        for i, (layers, refs, per_group) in enumerate(layout):
            pages = spans = rows = nbytes = 0
            for gi, n_refs, ref_bytes in per_group:
                g = groups[gi]
                pages += g.pages
                spans += g.spans
                rows += n_refs * g.spans
                nbytes += g.pages * ref_bytes
            chunks.append(ChunkPlan(i, layers, refs, pages, spans, rows, nbytes))
        return tuple(chunks)

    def _chunk_layout(self, direction: Direction,
                      groups: list[GroupPlan]) -> list[tuple[tuple[int, ...], tuple[ChunkRef, ...],
                                                           list[tuple[int, int, int]]]]:
        """Per chunk: (layers, refs, per group in it (group index, refs, bytes of its refs
        in a page))."""
        all_layers = sorted({layer for g in groups for layer in g.layers})
        if not all_layers:
            return []
        step = self.chunk_layers if direction is Direction.LOADBACK else len(all_layers)
        out = []
        for i in range(0, len(all_layers), step):
            layers = tuple(all_layers[i:i + step])
            lset = set(layers)
            refs: list[ChunkRef] = []
            per_group: list[tuple[int, int, int]] = []
            for gi, g in enumerate(groups):
                glayers = [layer for layer in g.layers if layer in lset]
                if not glayers:
                    continue
                n0, b = len(refs), 0
                for layer in glayers:
                    for comp in self.specs[g.group].components:
                        refs.append(ChunkRef(gi, g.group, comp.name, layer, comp.page_bytes))
                        b += comp.page_bytes
                per_group.append((gi, len(refs) - n0, b))
            out.append((layers, tuple(refs), per_group))
        return out

    # -- address tables -------------------------------------------------------------------
    def unit_runs(self, group: str) -> bool:
        """True when a page of ``group`` is not laid next to the one before in some region
        of either pool (a page-major host pool): its runs are then copied page by page."""
        hit = self._unit.get(group)
        if hit is None:
            spec = self.specs[group]
            hit = any(pool.page_stride(group, c.name, layer) != c.page_bytes for pool in (self.host, self.device)
                      for layer in spec.layers for c in spec.components)
            self._unit[group] = hit
        return hit

    def group_runs(self, group: GroupPlan) -> tuple[I64, I64, I64]:
        """The group's runs as the copies see them: single pages where :meth:`unit_runs`."""
        if self.unit_runs(group.group):
            return split_runs(group.run_src, group.run_dst, group.run_len, 1)
        return group.run_src, group.run_dst, group.run_len

    def _address(self, direction: Direction, group: GroupPlan,
                 refs: Sequence[ChunkRef]) -> tuple[I64, I64, I64, I64, I64]:
        """(source region offsets, destination region offsets, page bytes, source page
        strides, destination page strides) of ``refs``, int64 ``[len(refs)]`` each (cached)."""
        key = (direction, group.group, tuple((r.component, r.layer) for r in refs))
        hit = self._addr.get(key)
        if hit is not None:
            self.counters["address_hits"] += 1
            return hit
        self.counters["address_misses"] += 1
        src_pool, dst_pool = ((self.host, self.device) if direction is Direction.LOADBACK
                              else (self.device, self.host))
        so = np.array([src_pool.region_offset(r.group, r.component, r.layer) for r in refs], dtype=np.int64)
        do = np.array([dst_pool.region_offset(r.group, r.component, r.layer) for r in refs], dtype=np.int64)
        pb = np.array([r.page_bytes for r in refs], dtype=np.int64)
        ss = np.array([src_pool.page_stride(r.group, r.component, r.layer) for r in refs], dtype=np.int64)
        ds = np.array([dst_pool.page_stride(r.group, r.component, r.layer) for r in refs], dtype=np.int64)
        self._addr[key] = (so, do, pb, ss, ds)
        return so, do, pb, ss, ds

    def table(self, plan: FlushPlan, chunk: ChunkPlan, piece_bytes: int = DEFAULT_PIECE_BYTES) -> I64:
        """The chunk's copy table over both pools' unified address spans.

        Returns an int64 array ``[rows, 3]``: (source byte offset from the source pool's
        ``base_ptr``, destination byte offset from the destination pool's ``base_ptr``,
        bytes), one row per contiguous run per tensor ref, runs longer than
        ``piece_bytes`` split into pieces (cached on the chunk).
        """
        key = ("table", piece_bytes)
        cached = chunk.cache.get(key)
        if cached is not None:
            return cached  # type: ignore[no-any-return]
        by_group: dict[int, list[ChunkRef]] = {}
        for r in chunk.refs:
            by_group.setdefault(r.group_index, []).append(r)
        runs = {gi: self.group_runs(plan.groups[gi]) for gi in by_group}
        total = sum(len(refs) * runs[gi][0].shape[0] for gi, refs in by_group.items())
        rows = np.empty((total, 3), dtype=np.int64)
        at = 0
        for gi, refs in by_group.items():
            rs, rd, rl = runs[gi]
            so, do, pb, ss, ds = self._address(plan.direction, plan.groups[gi], refs)
            n_rows = len(refs) * rs.shape[0]
            block = rows[at:at + n_rows].reshape(len(refs), rs.shape[0], 3)
            np.multiply(rs[None, :], ss[:, None], out=block[:, :, 0])
            block[:, :, 0] += so[:, None]
            np.multiply(rd[None, :], ds[:, None], out=block[:, :, 1])
            block[:, :, 1] += do[:, None]
            np.multiply(rl[None, :], pb[:, None], out=block[:, :, 2])
            at += n_rows
        table = split_rows(rows, piece_bytes)
        chunk.cache[key] = table
        return table

    def run_table(self, plan: FlushPlan, piece_bytes: int = DEFAULT_PIECE_BYTES,
                  alloc: Callable[[int], I64] | None = None, cache: bool = True) -> RunTable:
        """The flush's copies in the run format (:class:`RunTable`; cached on the plan
        unless ``cache`` is False).

        Its size is (runs + refs) rows, not runs x refs: for 32,768 scattered 1 KiB
        pages over 8 layers, 0.8 MB instead of 6.3 MB. ``alloc(words)`` may supply the
        int64 buffer (e.g. a reused pinned staging buffer, so that it uploads without
        another copy: then pass ``cache=False``, since the buffer is written again
        later); default ``np.empty``.
        """
        key = ("runs", piece_bytes)
        cached = plan.cache.get(key)
        if cached is not None:
            return cached  # type: ignore[no-any-return]
        if isinstance(piece_bytes, bool) or not isinstance(piece_bytes, int) or piece_bytes <= 0 or piece_bytes % 16:
            raise ConfigError(f"piece_bytes must be a positive multiple of 16, got {piece_bytes!r}")
        segs: list[tuple[I64, I64, I64]] = []
        seg_pages: list[int] = []
        run0: list[int] = []
        n_runs = 0
        for g in plan.groups:
            max_pb = max(c.page_bytes for c in self.specs[g.group].components)
            s = 1 if self.unit_runs(g.group) else max(1, piece_bytes // max_pb)
            seg = split_runs(g.run_src, g.run_dst, g.run_len, s)
            segs.append(seg)
            seg_pages.append(s)
            run0.append(n_runs)
            n_runs += int(seg[2].shape[0])
        n_refs = [len(c.refs) for c in plan.chunks]
        words = RUN_COLS * n_runs + REF_COLS * sum(n_refs)
        packed = np.empty(words, dtype=np.int64) if alloc is None else alloc(words)
        if packed.shape != (words,) or packed.dtype != np.int64:
            raise ConfigError(f"run_table: alloc({words}) must return a 1-D int64 array of that many words, "
                              f"got {packed.dtype} {packed.shape}")
        runs = packed[:RUN_COLS * n_runs].reshape(n_runs, RUN_COLS)
        for (rs, rd, rl), at in zip(segs, run0):
            n = int(rl.shape[0])
            runs[at:at + n, 0] = rs
            runs[at:at + n, 1] = rd
            runs[at:at + n, 2] = rl
        chunk_refs: list[I64] = []
        chunk_word: list[int] = []
        chunk_items: list[int] = []
        word = RUN_COLS * n_runs
        for chunk, nr in zip(plan.chunks, n_refs):
            refs = packed[word:word + REF_COLS * nr].reshape(nr, REF_COLS)
            chunk_refs.append(refs)
            chunk_word.append(word)
            word += REF_COLS * nr
            by_group: dict[int, list[int]] = {}
            for j, r in enumerate(chunk.refs):
                by_group.setdefault(r.group_index, []).append(j)
            for gi, rows in by_group.items():
                so, do, pb, ss, ds = self._address(plan.direction, plan.groups[gi], [chunk.refs[j] for j in rows])
                idx = np.asarray(rows, dtype=np.int64)
                refs[idx, REF_SRC] = so
                refs[idx, REF_DST] = do
                refs[idx, REF_PAGE_BYTES] = pb
                refs[idx, REF_SRC_STRIDE] = ss
                refs[idx, REF_DST_STRIDE] = ds
                refs[idx, REF_RUN0] = run0[gi]
                refs[idx, REF_PIECES] = (seg_pages[gi] * pb + piece_bytes - 1) // piece_bytes
            if nr:
                n_seg = np.array([segs[r.group_index][2].shape[0] for r in chunk.refs], dtype=np.int64)
                per_ref = n_seg * refs[:, REF_PIECES]
                refs[:, REF_ITEM0] = np.cumsum(per_ref) - per_ref
                total = int(per_ref.sum())
                if total >= MAX_CHUNK_ITEMS:
                    raise ConfigError(f"run_table: chunk {chunk.index} has {total} work items; the kernel "
                                      f"numbers them in 32 bits (at most {MAX_CHUNK_ITEMS - 1}): use larger "
                                      f"piece_bytes or fewer pages per flush")
                chunk_items.append(total)
            else:
                chunk_items.append(0)
        rt = RunTable(piece_bytes, packed, runs, tuple(run0), tuple(seg_pages), tuple(chunk_refs),
                      tuple(chunk_word), tuple(chunk_items))
        if cache:
            plan.cache[key] = rt
        return rt
