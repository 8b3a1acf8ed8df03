"""The ``hybrid`` backend: the Numba SM kernel and the copy engines, chosen per flush.

For each flush and direction, every tensor ref of the plan goes to one engine
(:func:`.hybrid_choice.engine_for`: its mean bytes per contiguous run against the
calibrated crossover, which is lower when both directions are busy):

- the *copy engines*: its runs as one batch of ``cuMemcpyBatchAsync`` copies per
  chunk (:class:`.copy_engine.DriverBatchCopier`; addresses built with NumPy before
  the flush's start event, no Python object per copy);
- the *SM kernel*: the :class:`~.numba_sm.NumbaBackend` launch on at most
  ``blocks`` SMs, over a plan holding only those refs.

Within a chunk the batch is issued first (the copy engines start while the host
launches the kernel), then the kernel, then the chunk's event: layer-wise completion
is unchanged. A writeback's kernel part waits for the last loadback event when that
loadback is still running (the loadback keeps the link; the writeback's copy-engine
part runs at once). On CPU pools under the CUDA simulator the batches are
``memmove`` calls (:class:`.copy_engine.HostBatchCopier`) and the kernel the
simulator's: CI covers the split, the address arithmetic and the selection.

With a page-major host pool the backend also has the *staging path*
(:mod:`.staging`, issued by :mod:`.stager`): groups whose host pages form long extents
move through a device staging ring and one copy-engine copy per extent, chosen per chunk
and group before the split above (:mod:`.hybrid_choice`).

The calibration (:class:`.hybrid_choice.Calibration`) is measured when the backend binds on
a GPU (``calibration="measure"``, or ``"auto"`` without a committed one for the
device: about 0.3 s on scratch buffers), taken from :data:`.hybrid_choice.COMMITTED`
(``"auto"``), :data:`.hybrid_choice.DEFAULT_CALIBRATION` (``"default"``) or given. The
statistics report it (``stats()["backend"]["calibration"]``, with the crossovers)
and what each engine moved.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvtier.fsm import ConfigError, Direction

from ..errors import BackendUnavailable
from ..plan import DEFAULT_PIECE_BYTES, ChunkPlan, ChunkRef, FlushPlan, Planner, split_rows
from ..pools import DevicePool, HostPool
from .base import ChunkCounts, TransferEvent
from .copy_engine import BatchCopier, DriverBatchCopier, HostBatchCopier
from .hybrid_choice import CE, DEFAULT_CALIBRATION, SM, STAGING, Calibration, committed_calibration, copy_bytes
from .numba_sm import NumbaBackend
from .stager import Stager
from .staging import DEFAULT_SLOTS, DEFAULT_STAGING_BYTES, StagePlan

__all__ = ["HybridBackend", "CALIBRATION_SIZES"]

U64 = npt.NDArray[np.uint64]

#: Copy sizes (bytes) a start-up calibration measures (up to 4 MiB: the staging path's
#: host extents are compared with the crossover too).
CALIBRATION_SIZES = (4096, 8192, 16384, 32768, 65536, 131072, 1 << 20, 4 << 20)

#: Calibrations measured in this process (``"auto"`` measures once per device and settings).
_MEASURED: dict[tuple[Any, ...], Calibration] = {}

_OTHER = {Direction.LOADBACK: Direction.WRITEBACK, Direction.WRITEBACK: Direction.LOADBACK}


@dataclass(eq=False)
class _ChunkSplit:
    """One chunk's share of each engine."""

    sm_chunk: ChunkPlan
    dst: U64
    src: U64
    sizes: U64
    ce_bytes: int
    sm_bytes: int
    sm_copies: int

    @property
    def ce_copies(self) -> int:
        return int(self.sizes.shape[0])


@dataclass(eq=False)
class _Split:
    """A plan's split between the engines for one busy state (cached on the plan)."""

    busy: bool
    sm_plan: FlushPlan
    chunks: tuple[_ChunkSplit, ...]
    engines: dict[str, str]  # "group/component" -> engine, for the statistics
    stage: StagePlan | None = None

    @property
    def has_sm(self) -> bool:
        return any(c.sm_chunk.refs for c in self.chunks)


class HybridBackend(NumbaBackend):
    """SM kernel for small copies, copy engines for large ones (see the module docstring).

    Args:
        blocks, threads, piece_bytes, address_view, timing: as :class:`NumbaBackend`
            (``blocks``: most SMs a launch takes, default 8).
        calibration: ``"auto"`` (default: the committed calibration for the GPU, else
            measured at the first bind in the process with these settings),
            ``"measure"`` (measured at bind), ``"default"``, a :class:`Calibration` or
            its :meth:`~Calibration.as_dict` form. On CPU pools ``"auto"`` is ``"default"``.
        copier: the :class:`BatchCopier` to use (default: ``cuMemcpyBatchAsync`` on a
            GPU, ``memmove`` on CPU pools).
        writeback_waits: a writeback's kernel part waits for a running loadback
            (default True).
        staging_bytes: device staging memory of both directions (bytes; half each, in
            ``staging_slots`` slots) for the staging path (:mod:`.staging`), used with a
            page-major host pool; None (default): 192 MiB on a GPU, 4 MiB on CPU pools,
            when the host pool is page-major, else none; 0 turns it off.
        staging_slots: slots per direction (default 3).
        staging_min_bytes: a group's bytes of a chunk below this stay on the kernel or
            the copy engines (default 256 KiB).
        staging_one_way: stage a direction also while the other one is idle (default
            False: on the H200 one direction alone ran 1-16 % slower staged than on the
            kernel, both at once 13-40 % faster from 4 KiB pages up; bench/RESULTS.md).
        staging_host_tables: the staging kernels read their run table in place from
            pinned host memory instead of a device copy (default False; see
            :class:`.stager.Stager`).
        staging_ramp: smaller first pieces of a staged writeback and last pieces of each
            staged loadback chunk (default False: no gain measured on the H200; see
            :class:`.stager.Stager`).

    Raises:
        ConfigError: bad settings.
        BackendUnavailable (from ``bind``): as :class:`NumbaBackend`.
    """

    name = "hybrid"

    def __init__(self, blocks: int = 8, threads: int = 1024, piece_bytes: int = DEFAULT_PIECE_BYTES,
                 address_view: bool = True, timing: bool = True,
                 calibration: str | Calibration | Mapping[str, Any] = "auto", copier: BatchCopier | None = None,
                 writeback_waits: bool = True, staging_bytes: int | None = None,
                 staging_slots: int = DEFAULT_SLOTS, staging_min_bytes: int = 256 << 10,
                 staging_one_way: bool = False, staging_host_tables: bool = False,
                 staging_ramp: bool = False) -> None:
        super().__init__(blocks, threads, piece_bytes, address_view, timing)
        if isinstance(calibration, str):
            if calibration not in ("auto", "measure", "default"):
                raise ConfigError(f"hybrid backend: calibration must be 'auto', 'measure', 'default', a "
                                  f"Calibration or its dict, got {calibration!r}")
            self._cal_arg: str | Calibration = calibration
        elif isinstance(calibration, Calibration):
            self._cal_arg = calibration
        elif isinstance(calibration, Mapping):
            self._cal_arg = Calibration.from_dict(calibration)
        else:
            raise ConfigError(f"hybrid backend: calibration must be a str, Calibration or dict, got {calibration!r}")
        if copier is not None and not isinstance(copier, BatchCopier):
            raise ConfigError(f"hybrid backend: copier must be a BatchCopier, got {copier!r}")
        self.copier: BatchCopier | None = copier
        self.copier_error: str | None = None
        self.writeback_waits = bool(writeback_waits)
        if staging_bytes is not None and (isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int)
                                          or staging_bytes < 0):
            raise ConfigError(f"hybrid backend: staging_bytes must be None or an int >= 0, got {staging_bytes!r}")
        self._staging_args = (staging_bytes, staging_slots, staging_min_bytes)
        self.staging_one_way = bool(staging_one_way)
        self.staging_host_tables = bool(staging_host_tables)
        self.staging_ramp = bool(staging_ramp)
        self.stager: Stager | None = None
        self.calibration: Calibration | None = None
        self.calibration_seconds: float | None = None
        self._in_flush: set[Direction] = set()
        self._last: dict[Direction, TransferEvent] = {}
        self._split_now: dict[Direction, tuple[FlushPlan, _Split]] = {}
        self._xover: dict[tuple[Direction, bool], int | None] = {}
        self.waits = 0

    # -- binding ---------------------------------------------------------------------------
    def bind(self, host: HostPool, device: DevicePool, planner: Planner) -> None:
        super().bind(host, device, planner)
        if self.copier is None:
            if self.mode == "gpu":
                try:
                    self.copier = DriverBatchCopier(device.device.index or 0)
                except BackendUnavailable as e:
                    self.copier_error = str(e)
            else:
                self.copier = HostBatchCopier()
        nbytes, slots, min_bytes = self._staging_args
        if nbytes is None:
            nbytes = (DEFAULT_STAGING_BYTES if self.mode == "gpu" else 4 << 20) if host.page_major else 0
        self.stager = None
        if nbytes and self._views is not None and self.copier is not None:
            self.stager = Stager(self, nbytes, slots, min_bytes, self.staging_host_tables, self.staging_ramp)
            self.stager.bind()
        # with staging, a both-ways flush's writeback starts after the loadback's first chunk
        self.interleave_directions = self.stager is not None
        arg = self._cal_arg
        if isinstance(arg, Calibration):
            self.calibration = arg
        elif arg == "default":
            self.calibration = DEFAULT_CALIBRATION
        elif self.mode != "gpu":
            if arg == "measure":
                raise ConfigError("hybrid backend: calibration='measure' needs a GPU; give 'default' or a "
                                  "Calibration on CPU pools")
            self.calibration = DEFAULT_CALIBRATION
        elif self.copier is None:
            self.calibration = None  # no copy engines: everything on the kernel
        else:
            found = committed_calibration(torch.cuda.get_device_name(device.device)) if arg == "auto" else None
            if found is None:
                key = (str(device.device), self.blocks, self.threads, self.piece_bytes, self.copier.name)
                found = _MEASURED.get(key) if arg == "auto" else None
                if found is None:
                    found = self.calibrate()
                    _MEASURED[key] = found
            self.calibration = found

    # -- the split ---------------------------------------------------------------------------
    def _busy(self, direction: Direction) -> bool:
        other = _OTHER[direction]
        if other in self._in_flush:
            return True
        ev = self._last.get(other)
        return ev is not None and not ev.done()

    def engine_of(self, direction: Direction, plan: FlushPlan, ref: ChunkRef, busy: bool) -> str:
        """The engine that moves ``ref`` of ``plan`` (:data:`.hybrid_choice.SM` or :data:`.hybrid_choice.CE`)."""
        if self.copier is None or self.calibration is None:
            return SM
        key = (direction, busy)
        x = self._xover.get(key, -1)
        if x == -1:
            x = self._xover[key] = self.calibration.crossover(direction, busy)
        g = plan.groups[ref.group_index]
        if self.planner.unit_runs(g.group):  # page-major host: its runs are not contiguous (staging covers it)
            return SM
        return CE if x is not None and copy_bytes(g.pages, g.spans, ref.page_bytes) >= x else SM

    def split(self, direction: Direction, plan: FlushPlan, busy: bool) -> _Split:
        """The plan's refs split between the engines (cached on the plan per ``busy``)."""
        key = ("hybrid-split", busy, self.piece_bytes)
        hit = plan.cache.get(key)
        if hit is not None:
            return hit  # type: ignore[no-any-return]
        src_pool, dst_pool = (self.host, self.device) if direction is Direction.LOADBACK else (self.device, self.host)
        sb, db = src_pool.base_ptr, dst_pool.base_ptr
        engines: dict[str, str] = {}
        sm_chunks: list[ChunkPlan] = []
        parts: list[_ChunkSplit] = []
        staged: dict[int, frozenset[int]] = {}
        if (self.stager is not None and self.calibration is not None and self.copier is not None
                and (busy or self.staging_one_way)):
            x = self.calibration.crossover(direction, busy)
            staged = self.stager.choose(direction, plan, lambda size: x is not None and size >= x)
        for chunk in plan.chunks:
            sm_refs: list[ChunkRef] = []
            ce_by_group: dict[int, list[ChunkRef]] = {}
            skip = staged.get(chunk.index, frozenset())
            for r in chunk.refs:
                if r.group_index in skip:
                    engines[f"{r.group}/{r.component}"] = STAGING
                    continue
                e = self.engine_of(direction, plan, r, busy)
                engines[f"{r.group}/{r.component}"] = e
                if e == CE:
                    ce_by_group.setdefault(r.group_index, []).append(r)
                else:
                    sm_refs.append(r)
            dsts: list[npt.NDArray[np.int64]] = []
            srcs: list[npt.NDArray[np.int64]] = []
            sizes: list[npt.NDArray[np.int64]] = []
            ce_bytes = 0
            for gi, refs in ce_by_group.items():
                g = plan.groups[gi]
                so, do, pb, _, _ = self.planner._address(direction, g, refs)
                srcs.append((sb + so[:, None] + g.run_src[None, :] * pb[:, None]).reshape(-1))
                dsts.append((db + do[:, None] + g.run_dst[None, :] * pb[:, None]).reshape(-1))
                sizes.append((g.run_len[None, :] * pb[:, None]).reshape(-1))
                ce_bytes += g.pages * int(pb.sum())
            sm_groups = {r.group_index for r in sm_refs}
            sm_pages = sum(plan.groups[gi].pages for gi in sm_groups)
            sm_spans = sum(plan.groups[gi].spans for gi in sm_groups)
            sm_rows = sum(plan.groups[r.group_index].spans for r in sm_refs)
            sm_bytes = sum(plan.groups[r.group_index].pages * r.page_bytes for r in sm_refs)
            sm_chunk = ChunkPlan(chunk.index, chunk.layers, tuple(sm_refs), sm_pages, sm_spans, sm_rows, sm_bytes)
            sm_chunks.append(sm_chunk)

            def cat(xs: list[npt.NDArray[np.int64]]) -> U64:
                return (np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)).astype(np.uint64)

            parts.append(_ChunkSplit(sm_chunk, cat(dsts), cat(srcs), cat(sizes), ce_bytes, sm_bytes, sm_rows))
        sm_plan = FlushPlan(direction, plan.groups, tuple(sm_chunks), {})
        stage = self.stager.build(direction, plan, staged) if staged and self.stager is not None else None
        out = _Split(busy, sm_plan, tuple(parts), engines, stage)
        plan.cache[key] = out
        return out

    # -- issuing ------------------------------------------------------------------------------
    def preflight(self, plans: list[FlushPlan]) -> None:
        self._in_flush = {p.direction for p in plans if p.chunks}

    def prepare(self, direction: Direction, plan: FlushPlan) -> None:
        """Split the plan between the engines (both directions of this flush, or the
        other one still running, count as busy); build and upload the kernel part's run
        table and the batches' address arrays, all before the start event."""
        s = self.split(direction, plan, self._busy(direction))
        self._split_now[direction] = (plan, s)
        if s.stage is not None and self.stager is not None:
            self.stager.upload(direction, plan, s.stage)
        if s.has_sm:
            super().prepare(direction, s.sm_plan)

    def _stream_handle(self, direction: Direction) -> int:
        if self.mode == "gpu":
            return int(self.streams.stream(direction).cuda_stream)
        return 0

    def run_chunk(self, direction: Direction, plan: FlushPlan, chunk: ChunkPlan,
                  op_ids: tuple[int, ...]) -> ChunkCounts:
        cur = self._split_now.get(direction)
        s = cur[1] if cur is not None and cur[0] is plan else self.split(direction, plan, self._busy(direction))
        part = s.chunks[chunk.index]
        staged = (0, 0, 0, 0)
        if s.stage is not None and self.stager is not None:
            staged = self.stager.issue(direction, plan, s.stage, chunk.index)
        ce_calls = 0
        if part.ce_copies:
            assert self.copier is not None
            ce_calls = self.copier.copy(direction, part.dst, part.src, part.sizes, self._stream_handle(direction))
        waited = 0
        sm = ChunkCounts()
        if part.sm_chunk.refs:
            if direction is Direction.WRITEBACK and self.writeback_waits:
                ev = self._last.get(Direction.LOADBACK)
                if ev is not None and not ev.done():
                    if self.mode == "gpu":
                        self.streams.wait_on(direction, ev)
                    waited = 1
                    self.waits += 1
            sm = super().run_chunk(direction, s.sm_plan, part.sm_chunk, op_ids)
        return ChunkCounts(copy_calls=ce_calls + staged[1], kernel_launches=sm.kernel_launches + staged[3],
                           thread_blocks=max(sm.thread_blocks, self._grid(1 << 30) if staged[3] else 0),
                           sm_bytes=part.sm_bytes if sm.kernel_launches else 0,
                           sm_copies=part.sm_copies if sm.kernel_launches else 0,
                           ce_bytes=part.ce_bytes, ce_copies=part.ce_copies, ce_calls=ce_calls, waits=waited,
                           stage_bytes=staged[0], stage_copies=staged[1], ring_waits=staged[2])

    def begin(self, direction: Direction) -> TransferEvent:
        ev = super().begin(direction)
        if self.stager is not None:
            self.stager.begin(direction)
        return ev

    def synchronize(self) -> None:
        super().synchronize()
        if self.stager is not None:
            self.stager.synchronize()

    def record(self, direction: Direction) -> TransferEvent:
        ev = super().record(direction)
        self._last[direction] = ev
        return ev

    # -- calibration ----------------------------------------------------------------------------
    def calibrate(self, sizes: tuple[int, ...] = CALIBRATION_SIZES, total_bytes: int = 32 << 20,
                  reps: int = 3) -> Calibration:
        """Measure both engines on scratch buffers of this device (GPU only): for each
        copy size, ``total_bytes`` in scattered copies of that size, each direction
        alone by the kernel and by batched copies, and both directions batched at once;
        medians of ``reps`` after a warm-up. Times run from an event recorded on the idle
        stream before the launch or call to one after it, so the host's time to issue
        counts. About 0.3 s on an H200.

        Raises:
            ConfigError: not bound to a GPU, or no copy engine."""
        if self.mode != "gpu" or self.copier is None:
            raise ConfigError("hybrid backend: calibrate() needs a GPU and the copy engines "
                              f"(mode {self.mode}, copier {self.copier_error or 'present'})")
        copier = self.copier
        t0 = time.perf_counter()
        dev = self.device.device
        host = torch.empty(2 * total_bytes, dtype=torch.uint8, pin_memory=True)
        devb = torch.empty(2 * total_bytes, dtype=torch.uint8, device=dev)
        hp, dp = int(host.data_ptr()), int(devb.data_ptr())
        views = {"host": self._k.span_arrays(hp, 2 * total_bytes, host),
                 "device": self._k.span_arrays(dp, 2 * total_bytes, devb)}
        streams = {d: self.streams.stream(d) for d in (Direction.LOADBACK, Direction.WRITEBACK)}
        rng = np.random.default_rng(0)
        sm: dict[Direction, list[float]] = {d: [] for d in streams}
        ce: dict[Direction, list[float]] = {d: [] for d in streams}
        pair: dict[Direction, list[float]] = {d: [] for d in streams}

        def timed(parts: list[tuple[Direction, Callable[[], Any]]], total: int) -> dict[Direction, float]:
            out: dict[Direction, list[float]] = {d: [] for d, _ in parts}
            for rep in range(reps + 1):
                torch.cuda.synchronize(dev)
                first = streams[parts[0][0]]
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record(first)
                ends = []
                for d, fn in parts:
                    if streams[d] is not first:
                        streams[d].wait_event(start)
                    fn()
                    e = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                    e.record(streams[d])
                    ends.append((d, e))
                torch.cuda.synchronize(dev)
                if rep:
                    for d, e in ends:
                        out[d].append(total / (start.elapsed_time(e) / 1e3) / 1e9)
            return {d: statistics.median(v) for d, v in out.items()}

        keep: list[Any] = []
        for size in sizes:
            n = total_bytes // size
            total = n * size
            ops: dict[Direction, tuple[Callable[[], Any], Callable[[], Any]]] = {}
            for d in streams:
                s_off = rng.permutation(n).astype(np.int64) * size
                d_off = rng.permutation(n).astype(np.int64) * size
                if d is Direction.WRITEBACK:  # the other halves: both directions may run at once
                    s_off += total_bytes
                    d_off += total_bytes
                s_base, d_base = (hp, dp) if d is Direction.LOADBACK else (dp, hp)
                src = (s_base + s_off).astype(np.uint64)
                dst = (d_base + d_off).astype(np.uint64)
                szs = np.full(n, size, dtype=np.uint64)
                rows = split_rows(np.stack([s_off, d_off, np.full(n, size, dtype=np.int64)], axis=1),
                                  self.piece_bytes)
                runs, refs, piece = self._k.rows_as_runs(rows)
                table = torch.from_numpy(np.concatenate([runs, refs])).to(dev)
                keep.append(table)
                nb = self._k.device_array(table)
                sv, dv = (views["host"], views["device"]) if d is Direction.LOADBACK else (views["device"],
                                                                                             views["host"])
                items = int(rows.shape[0])
                ref_word = int(runs.shape[0])
                stream = self._nb_streams[d]
                handle = int(streams[d].cuda_stream)

                def kernel(sv: Any = sv, dv: Any = dv, nb: Any = nb, ref_word: int = ref_word, items: int = items,
                           piece: int = piece, stream: Any = stream) -> None:
                    self._k.launch_runs(sv[0], dv[0], sv[1], dv[1], nb, nb, ref_word, 1, items, piece,
                                        self._grid(items), self.threads, stream)

                def batch(d: Direction = d, dst: U64 = dst, src: U64 = src, szs: U64 = szs,
                          handle: int = handle) -> None:
                    copier.copy(d, dst, src, szs, handle)

                ops[d] = (kernel, batch)
            for d in streams:
                sm[d].append(timed([(d, ops[d][0])], total)[d])
                ce[d].append(timed([(d, ops[d][1])], total)[d])
            both = timed([(d, ops[d][1]) for d in streams], total)
            for d in streams:
                pair[d].append(both[d])
        del keep, host, devb, views
        secs = time.perf_counter() - t0
        self.calibration_seconds = secs
        return Calibration(tuple(sizes), {d: tuple(v) for d, v in sm.items()}, {d: tuple(v) for d, v in ce.items()},
                           {d: tuple(v) for d, v in pair.items()},
                           source=f"measured at bind on {torch.cuda.get_device_name(dev)}",
                           extra={"device": torch.cuda.get_device_name(dev), "blocks": self.blocks,
                                  "threads": self.threads, "piece_bytes": self.piece_bytes,
                                  "bytes_per_measure": total_bytes, "reps": reps, "copier": copier.name,
                                  "seconds": round(secs, 3)})

    def describe(self) -> dict[str, object]:
        d = super().describe()
        d.update({"name": self.name, "copier": self.copier.name if self.copier is not None else None,
                  "copier_error": self.copier_error, "writeback_waits": self.writeback_waits,
                  "writeback_waits_done": self.waits,
                  "calibration": self.calibration.as_dict() if self.calibration is not None else None,
                  "calibration_seconds": self.calibration_seconds,
                  "staging": self.stager.describe() if self.stager is not None else None})
        return d
