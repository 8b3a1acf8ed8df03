"""The ``numba`` backend: zero-copy Numba-CUDA kernels (:mod:`.kernels`).

Each side of a copy is seen as one array from its pool's base address (the lowest
region address; every registered tensor and the pinned host pool live in one unified
address space), so one launch of :func:`kernels.copy_runs` covers every group,
component and layer of a chunk: ``kernel_launches`` = chunks. Before the flush's
start event (:meth:`NumbaBackend.prepare`), the flush's run table
(:meth:`Planner.run_table`: each group's runs once, plus a few rows per chunk, one
per tensor ref) is written straight into a reused pinned staging buffer (one per
direction) and copied to the device in one upload on a stream of its own (the
direction's stream waits for it), cached with the plan; the kernel expands runs x
refs itself.

Where one view per side cannot be used (``address_view=False``, or under the CUDA
simulator with registered tensors, which are not one NumPy buffer) the backend falls
back to one launch per tensor bucket, i.e. per (source region, destination region)
pair, with views of those two tensors and one ref row each; the statistics report
the launch count.

On a GPU, :meth:`NumbaBackend.bind` compiles the kernel (an empty launch), so the
first flush does not pay Numba's compilation.

Under the CUDA simulator (tests only; never chosen automatically) the device pool is
a CPU pool and the kernel runs on NumPy views, synchronously.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.fsm import ConfigError, Direction

from ..errors import BackendUnavailable
from ..plan import DEFAULT_PIECE_BYTES, REF_COLS, REF_DST, REF_ITEM0, REF_SRC, ChunkPlan, ChunkRef, FlushPlan, \
    Planner
from ..pools import DevicePool, HostPool, _Pool
from .base import Backend, ChunkCounts, DoneEvent, TransferEvent

__all__ = ["NumbaBackend"]


@dataclass(eq=False)
class _FlushTable:
    """What a launch needs of a plan's run table, with its device copy (cached on the
    plan; the host-side table itself lives in a reused staging buffer)."""

    ref_word: tuple[int, ...]
    items: tuple[int, ...]
    refs: tuple[np.ndarray, ...]
    nbytes: int
    owner: Any
    table: Any


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"numba backend: {name} must be a positive int, got {value!r}")
    return value


class NumbaBackend(Backend):
    """Persistent zero-copy copy kernel, one launch per chunk.

    Args:
        blocks: most thread blocks per launch (default 8: 8 of the H200's 132 SMs;
            fewer when the chunk has fewer rows than warps).
        threads: threads per block (default 1024; a multiple of 32 on a GPU, at most 1024).
        piece_bytes: largest table row; longer runs are split (default 16 KiB).
        address_view: one view per pool side (default); False forces one launch per
            tensor bucket.
        timing: time flushes with CUDA events (default True).

    Raises:
        ConfigError: bad settings.
        BackendUnavailable (from ``bind``): numba-cuda unusable, a CUDA pool under the
            simulator, or a CPU pool without it.
    """

    name = "numba"

    def __init__(self, blocks: int = 8, threads: int = 1024, piece_bytes: int = DEFAULT_PIECE_BYTES,
                 address_view: bool = True, timing: bool = True) -> None:
        self.blocks = _positive("blocks", blocks)
        self.threads = _positive("threads", threads)
        if threads > 1024:
            raise ConfigError(f"numba backend: threads must be <= 1024, got {threads}")
        self.piece_bytes = _positive("piece_bytes", piece_bytes)
        if piece_bytes % 16:
            raise ConfigError(f"numba backend: piece_bytes must be a multiple of 16, got {piece_bytes}")
        self.address_view = bool(address_view)
        self.timing = timing
        self.mode = "unbound"
        self.sm_count: int | None = None
        self._views: dict[str, tuple[Any, Any]] | None = None
        self._stage: dict[Any, torch.Tensor] = {}  # reused pinned table buffers, by key
        self._stage_event: dict[Any, torch.cuda.Event] = {}

    # -- binding --------------------------------------------------------------------------
    def bind(self, host: HostPool, device: DevicePool, planner: Planner) -> None:
        try:
            from . import kernels
        except Exception as e:  # pragma: no cover - depends on the machine
            raise BackendUnavailable(f"backend 'numba' needs numba-cuda, which failed to import: {e}") from e
        super().bind(host, device, planner)
        self._k = kernels
        if device.device.type == "cuda":
            if kernels.SIMULATOR:
                raise BackendUnavailable("backend 'numba' with a CUDA device pool cannot run under the CUDA "
                                         "simulator (NUMBA_ENABLE_CUDASIM=1); use 'torch', or a CPU pool")
            if self.threads % 32:
                raise ConfigError(f"numba backend: threads must be a multiple of 32 on a GPU, got {self.threads}")
            from .cuda_streams import CudaStreams

            self.mode = "gpu"
            self.streams = CudaStreams(device.device, self.timing)
            with torch.cuda.device(device.device):
                self._nb_streams = {d: kernels.external_stream(s.cuda_stream)
                                    for d, s in self.streams.streams.items()}
            lo, hi = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
            self._upload_stream = torch.cuda.Stream(device=device.device,  # type: ignore[no-untyped-call]
                                                    priority=min(lo, hi))
            self.sm_count = int(torch.cuda.get_device_properties(device.device).multi_processor_count)
            if self.address_view:
                self._views = {
                    "host": kernels.span_arrays(host.base_ptr, host.span_bytes, host),
                    "device": kernels.span_arrays(device.base_ptr, device.span_bytes, device),
                }
            self._bind_launcher(self._compile_now())
        else:
            if not kernels.SIMULATOR:
                raise BackendUnavailable(f"backend 'numba' with a device pool on {device.device} needs the CUDA "
                                         f"simulator (NUMBA_ENABLE_CUDASIM=1 before Python starts); use 'cpu'")
            self.mode = "sim"
            if self.address_view and host.buffer is not None and device.buffer is not None:
                self._views = {"host": self._np_views(host), "device": self._np_views(device)}

    def _compile_now(self) -> tuple[Any, ...]:
        """Compile the kernel for the argument types of real launches with an empty
        launch (no work item), so that no flush pays Numba's compilation; returns the
        launch's array arguments."""
        scratch = torch.zeros(2 * REF_COLS, dtype=torch.int64, device=self.device.device)
        view = self._k.span_arrays(int(scratch.data_ptr()), int(scratch.numel()) * 8, scratch)
        table = self._k.device_array(scratch)
        stream = self._nb_streams[Direction.LOADBACK]
        self._k.launch_runs(view[0], view[0], view[1], view[1], table, table, 0, 1, 0, self.piece_bytes, 1,
                            self.threads, stream)
        self.streams.stream(Direction.LOADBACK).synchronize()
        return (view[0], view[0], view[1], view[1], table, table)

    def _bind_launcher(self, sample: tuple[Any, ...]) -> None:
        """Pre-bind the kernel's launch (:class:`.driver.BoundKernel`, checked by its
        self-test); when that fails, launches go through Numba (``bound_error`` says why)."""
        from .driver import BoundKernel

        self.bound_error: str | None = None
        try:
            bound = BoundKernel(self._k, sample)
            err = bound.self_test(self.device.device)
            if err is not None:
                raise BackendUnavailable(err)
            self._bound: BoundKernel | None = bound
            self._launcher: Any = bound.launch
            return
        except Exception as e:  # the ordinary launch still works
            self.bound_error = f"{type(e).__name__}: {e}"
            self._bound = None
        by_handle: dict[int, Any] = {}

        def numba_launch(*args: Any) -> None:
            handle = args[-1]
            stream = by_handle.get(handle)
            if stream is None:
                stream = by_handle[handle] = self._k.external_stream(handle)
            self._k.launch_runs(*args[:-1], stream)

        self._launcher = numba_launch

    def _np_views(self, pool: _Pool) -> tuple[Any, Any]:
        buf = pool.single_buffer()
        assert buf is not None and int(buf.data_ptr()) == pool.base_ptr
        return self._sim_views(buf.numpy())

    def _sim_views(self, u8: np.ndarray) -> tuple[Any, Any]:
        """(uint32, uint8) simulator views of one uint8 NumPy buffer, aliasing it."""
        u32 = u8[: u8.shape[0] // 4 * 4].view(np.uint32)
        return self._k.device_array(u32), self._k.device_array(u8)

    def _side_names(self, direction: Direction) -> tuple[str, str]:
        return ("host", "device") if direction is Direction.LOADBACK else ("device", "host")

    def _pool(self, side: str) -> _Pool:
        return self.host if side == "host" else self.device

    # -- issuing ------------------------------------------------------------------------------
    def begin(self, direction: Direction) -> TransferEvent:
        if self.mode == "gpu":
            return self.streams.begin(direction)
        return DoneEvent()

    def record(self, direction: Direction) -> TransferEvent:
        if self.mode == "gpu":
            return self.streams.record(direction)
        return DoneEvent()

    def _upload(self, direction: Direction, words: np.ndarray) -> tuple[Any, Any]:
        """(owner, Numba view) of a device copy of a small int64 array, on the
        direction's stream (simulator: the array itself)."""
        if self.mode != "gpu":
            return words, self._k.device_array(words)
        with torch.cuda.stream(self.streams.stream(direction)):
            t = torch.from_numpy(words).pin_memory().to(self.device.device, non_blocking=True)
        return t, self._k.device_array(t)

    def _staging(self, direction: Any, words: int) -> np.ndarray:
        """A pinned host buffer of ``words`` int64 for the direction's next table (one
        buffer per direction, reused; grown by doubling). Waits for the buffer's last
        upload, which runs on its own stream and so is normally long finished."""
        buf = self._stage.get(direction)
        if buf is None or int(buf.numel()) < words:
            size = max(words, 1 << 16, 2 * int(buf.numel()) if buf is not None else 0)
            # the old buffer goes back to torch's pinned-memory cache, which knows only of
            # torch's own copies: the staging path copies and reads it with driver calls,
            # so its last use must be over first
            ev = self._stage_event.get(direction)
            if ev is not None:
                ev.synchronize()
            buf = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self._stage[direction] = buf
            self._stage_event.pop(direction, None)
        else:
            ev = self._stage_event.get(direction)
            if ev is not None:
                ev.synchronize()
        return buf[:words].numpy()

    def _upload_staged(self, direction: Direction, words: int, key: Any = None) -> tuple[Any, Any]:
        """Copy the first ``words`` of the pinned buffer ``key`` (default: the
        direction's, :meth:`_staging`) to a new device tensor on the upload stream; the
        direction's stream waits for the copy."""
        key = direction if key is None else key
        stream = self.streams.stream(direction)
        with torch.cuda.stream(self._upload_stream):
            t = torch.empty(words, dtype=torch.int64, device=self.device.device)
            t.copy_(self._stage[key][:words], non_blocking=True)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(self._upload_stream)
        self._stage_event[key] = ev
        stream.wait_event(ev)
        t.record_stream(stream)  # freed with its plan: not reused before the kernels that read it finish
        return t, self._k.device_array(t)

    def _flush_table(self, direction: Direction, plan: FlushPlan) -> _FlushTable:
        """The plan's run table on the device (built and uploaded once, cached)."""
        key = ("numba-runs", self.piece_bytes)
        hit = plan.cache.get(key)
        if hit is not None:
            return hit  # type: ignore[no-any-return]
        if self.mode == "gpu":
            rt = self.planner.run_table(plan, self.piece_bytes, lambda n: self._staging(direction, n), cache=False)
            owner, nb = self._upload_staged(direction, int(rt.packed.shape[0]))
        else:
            rt = self.planner.run_table(plan, self.piece_bytes)
            owner, nb = rt.packed, self._k.device_array(rt.packed)
        ft = _FlushTable(rt.chunk_ref_word, rt.chunk_items, tuple(r.copy() for r in rt.chunk_refs), rt.nbytes,
                         owner, nb)
        plan.cache[key] = ft
        return ft

    def prepare(self, direction: Direction, plan: FlushPlan) -> None:
        """Build and upload the flush's run table before the start event, so the
        device time measured from that event is the copies' alone."""
        if plan.chunks:
            self._flush_table(direction, plan)

    def _grid(self, items: int) -> int:
        warps_per_block = max(1, self.threads // 32)
        return max(1, min(self.blocks, -(-items // warps_per_block)))

    def _launch(self, direction: Direction, src: tuple[Any, Any], dst: tuple[Any, Any], runs: Any, refs: Any,
                ref_word: int, nrefs: int, items: int) -> int:
        blocks = self._grid(items)
        if self.mode == "gpu":
            self._launcher(src[0], dst[0], src[1], dst[1], runs, refs, ref_word, nrefs, items, self.piece_bytes,
                           blocks, self.threads, int(self.streams.stream(direction).cuda_stream))
        else:
            self._k.launch_runs(src[0], dst[0], src[1], dst[1], runs, refs, ref_word, nrefs, items, self.piece_bytes,
                                blocks, self.threads, 0)
        return blocks

    def run_chunk(self, direction: Direction, plan: FlushPlan, chunk: ChunkPlan,
                  op_ids: tuple[int, ...]) -> ChunkCounts:
        src_side, dst_side = self._side_names(direction)
        ft = self._flush_table(direction, plan)
        table = ft.table
        refs = ft.refs[chunk.index]
        items = ft.items[chunk.index]
        if items == 0:
            return ChunkCounts()
        if self._views is not None:
            blocks = self._launch(direction, self._views[src_side], self._views[dst_side], table, table,
                                  ft.ref_word[chunk.index], int(refs.shape[0]), items)
            return ChunkCounts(kernel_launches=1, thread_blocks=blocks, sm_bytes=chunk.nbytes, sm_copies=chunk.rows)
        # one launch per tensor bucket: region views, ref rows with offsets from them
        key = ("numba-buckets", self.piece_bytes)
        cached = chunk.cache.get(key)
        if cached is None:
            views = []
            rows = refs.copy()
            ends = np.append(refs[1:, REF_ITEM0], items)
            for i, r in enumerate(chunk.refs):
                src_view, s_delta = self._region_view(src_side, r)
                dst_view, d_delta = self._region_view(dst_side, r)
                views.append((src_view, dst_view, int(ends[i] - refs[i, REF_ITEM0])))
                rows[i, REF_SRC] = s_delta
                rows[i, REF_DST] = d_delta
                rows[i, REF_ITEM0] = 0
            owner, nb = self._upload(direction, rows.reshape(-1))
            cached = (views, owner, nb)
            chunk.cache[key] = cached
        views, _, bucket_refs = cached
        launches = max_blocks = 0
        for i, (src_view, dst_view, n_items) in enumerate(views):
            if n_items == 0:
                continue
            blocks = self._launch(direction, src_view, dst_view, table, bucket_refs, REF_COLS * i, 1, n_items)
            launches += 1
            max_blocks = max(max_blocks, blocks)
        return ChunkCounts(kernel_launches=launches, thread_blocks=max_blocks, sm_bytes=chunk.nbytes,
                           sm_copies=chunk.rows)

    def _region_view(self, side: str, r: ChunkRef) -> tuple[tuple[Any, Any], int]:
        pool = self._pool(side)
        region = pool.region(r.group, r.component, r.layer)
        extent = (region.shape[0] - 1) * region.stride(0) + region.shape[1]  # strided in a page-major pool
        if self.mode == "gpu":
            ptr = int(region.data_ptr())
            base = ptr // 16 * 16
            delta = ptr - base
            nbytes = -(-(delta + extent) // 16) * 16
            return self._k.span_arrays(base, nbytes, region), delta
        if region.is_contiguous():
            return self._sim_views(region.reshape(-1).numpy()), 0
        buf = pool.single_buffer()  # a strided region: a flat view of its bytes in the pool's buffer
        assert buf is not None
        off = pool.region_offset(r.group, r.component, r.layer)
        return self._sim_views(buf[off:off + extent].numpy()), 0

    # -- waiting and timing -----------------------------------------------------------------------
    def wait(self, event: TransferEvent) -> None:
        if self.mode == "gpu":
            self.streams.wait(event)

    def elapsed(self, start: TransferEvent, end: TransferEvent) -> float | None:
        if self.mode == "gpu":
            return self.streams.elapsed(start, end)
        if isinstance(start, DoneEvent) and isinstance(end, DoneEvent):
            return max(0.0, end.t - start.t)
        return None

    def synchronize(self) -> None:
        if self.mode == "gpu":
            self.streams.synchronize()

    def describe(self) -> dict[str, object]:
        bound = getattr(self, "_bound", None)
        return {"name": self.name, "mode": self.mode, "blocks": self.blocks, "threads": self.threads,
                "piece_bytes": self.piece_bytes, "address_view": self._views is not None,
                "sm_count": self.sm_count, "bound_launch": bound is not None,
                "bound_error": getattr(self, "bound_error", None),
                "bound_launches": bound.launches if bound is not None else 0}
