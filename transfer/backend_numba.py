"""The ``numba`` backend: zero-copy Numba-CUDA kernels (:mod:`.kernels`).

Each side of a copy is seen as one array from its pool's base address (the lowest
region address; every registered tensor and the pinned host pool live in one unified
address space), so one launch of :func:`kernels.copy_table` covers every group,
component and layer of a chunk: ``kernel_launches`` = chunks. The chunk's table
(int64 ``[rows, 3]`` of byte offsets and lengths, :meth:`Planner.table`) is copied to
the device once and cached with the plan.

Where one view per side cannot be used (``address_view=False``, or under the CUDA
simulator with registered tensors, which are not one NumPy buffer) the backend falls
back to one launch per tensor bucket, i.e. per (source region, destination region)
pair, with views of those two tensors; the statistics report the launch count.

Under the CUDA simulator (tests only; never chosen automatically) the device pool is
a CPU pool and the kernel runs on NumPy views, synchronously.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvtier.fsm import ConfigError, Direction

from .backend import Backend, ChunkCounts, DoneEvent, TransferEvent
from .errors import BackendUnavailable
from .plan import DEFAULT_PIECE_BYTES, ChunkPlan, ChunkRef, FlushPlan, Planner, split_rows
from .pools import DevicePool, HostPool, _Pool

__all__ = ["NumbaBackend"]


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
            self.sm_count = int(torch.cuda.get_device_properties(device.device).multi_processor_count)
            if self.address_view:
                self._views = {
                    "host": kernels.span_arrays(host.base_ptr, host.span_bytes, host),
                    "device": kernels.span_arrays(device.base_ptr, device.span_bytes, device),
                }
        else:
            if not kernels.SIMULATOR:
                raise BackendUnavailable(f"backend 'numba' with a device pool on {device.device} needs the CUDA "
                                         f"simulator (NUMBA_ENABLE_CUDASIM=1 before Python starts); use 'cpu'")
            self.mode = "sim"
            if self.address_view and host.buffer is not None and device.buffer is not None:
                self._views = {"host": self._np_views(host), "device": self._np_views(device)}

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

    def _grid(self, rows: int) -> int:
        warps_per_block = max(1, self.threads // 32)
        return max(1, min(self.blocks, -(-rows // warps_per_block)))

    def _device_table(self, chunk: ChunkPlan, key: Any, table: np.ndarray, direction: Direction) -> Any:
        hit = chunk.cache.get(key)
        if hit is not None:
            return hit[1]
        if self.mode == "gpu":
            with torch.cuda.stream(self.streams.stream(direction)):
                t = torch.from_numpy(table).pin_memory().to(self.device.device, non_blocking=True)
            nb = self._k.device_array(t)
            chunk.cache[key] = (t, nb)
            return nb
        nb = self._k.device_array(table)
        chunk.cache[key] = (table, nb)
        return nb

    def _launch(self, direction: Direction, src: tuple[Any, Any], dst: tuple[Any, Any], table: Any,
                rows: int) -> int:
        blocks = self._grid(rows)
        stream = self._nb_streams[direction] if self.mode == "gpu" else 0
        self._k.launch_copy(src[0], dst[0], src[1], dst[1], table, rows, blocks, self.threads, stream)
        return blocks

    def run_chunk(self, direction: Direction, plan: FlushPlan, chunk: ChunkPlan,
                  op_ids: tuple[int, ...]) -> ChunkCounts:
        src_side, dst_side = self._side_names(direction)
        if self._views is not None:
            table = self.planner.table(plan, chunk, self.piece_bytes)
            rows = int(table.shape[0])
            if rows == 0:
                return ChunkCounts()
            dev = self._device_table(chunk, ("numba", self.piece_bytes), table, direction)
            blocks = self._launch(direction, self._views[src_side], self._views[dst_side], dev, rows)
            return ChunkCounts(kernel_launches=1, thread_blocks=blocks)
        launches = max_blocks = 0
        for i, r in enumerate(chunk.refs):
            src_view, s_delta = self._region_view(src_side, r)
            dst_view, d_delta = self._region_view(dst_side, r)
            g = plan.groups[r.group_index]
            key = ("numba-bucket", self.piece_bytes, i)
            cached = chunk.cache.get(("rows",) + key[1:])
            if cached is None:
                pb = r.page_bytes
                rows_arr = np.stack((s_delta + g.run_src * pb, d_delta + g.run_dst * pb, g.run_len * pb), axis=1)
                cached = split_rows(rows_arr, self.piece_bytes)
                chunk.cache[("rows",) + key[1:]] = cached
            if cached.shape[0] == 0:
                continue
            dev = self._device_table(chunk, key, cached, direction)
            blocks = self._launch(direction, src_view, dst_view, dev, int(cached.shape[0]))
            launches += 1
            max_blocks = max(max_blocks, blocks)
        return ChunkCounts(kernel_launches=launches, thread_blocks=max_blocks)

    def _region_view(self, side: str, r: ChunkRef) -> tuple[tuple[Any, Any], int]:
        region = self._pool(side).region(r.group, r.component, r.layer)
        if self.mode == "gpu":
            ptr = int(region.data_ptr())
            base = ptr // 16 * 16
            delta = ptr - base
            nbytes = -(-(delta + region.numel()) // 16) * 16
            return self._k.span_arrays(base, nbytes, region), delta
        return self._sim_views(region.reshape(-1).numpy()), 0

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
        return {"name": self.name, "mode": self.mode, "blocks": self.blocks, "threads": self.threads,
                "piece_bytes": self.piece_bytes, "address_view": self._views is not None,
                "sm_count": self.sm_count}
