"""The ``cpu`` backend: synchronous index copies with torch on CPU tensors.

For machines without a GPU (and as the reference the other backends are tested
against). Both pools must be CPU pools; every copy has finished when
:meth:`CpuBackend.run_chunk` returns.
"""

from __future__ import annotations

from kvtier.fsm import Direction

from .backend import Backend, ChunkCounts, DoneEvent, TransferEvent
from .errors import BackendUnavailable
from .plan import ChunkPlan, FlushPlan, Planner
from .pools import DevicePool, HostPool, _Pool

__all__ = ["CpuBackend", "copy_chunk_indexed"]


def copy_chunk_indexed(src_pool: _Pool, dst_pool: _Pool, plan: FlushPlan, chunk: ChunkPlan) -> int:
    """Copy every ref of ``chunk`` with one ``index_select`` + ``index_copy_`` per ref.

    Returns the number of copy calls (one per ref)."""
    calls = 0
    for r in chunk.refs:
        g = plan.groups[r.group_index]
        s_idx, d_idx = g.index_tensors()
        src = src_pool.region(r.group, r.component, r.layer)
        dst = dst_pool.region(r.group, r.component, r.layer)
        dst.index_copy_(0, d_idx, src.index_select(0, s_idx))
        calls += 1
    return calls


class CpuBackend(Backend):
    """Synchronous CPU copies (``index_copy_``); events are complete at once."""

    name = "cpu"

    def bind(self, host: HostPool, device: DevicePool, planner: Planner) -> None:
        if device.device.type != "cpu" or host.device.type != "cpu":
            raise BackendUnavailable(f"backend {self.name!r} needs CPU pools, got a device pool on "
                                     f"{device.device} (use backend 'torch' or 'numba' for CUDA)")
        super().bind(host, device, planner)

    def sides(self, direction: Direction) -> tuple[_Pool, _Pool]:
        """(source pool, destination pool) of a direction."""
        if direction is Direction.LOADBACK:
            return self.host, self.device
        return self.device, self.host

    def run_chunk(self, direction: Direction, plan: FlushPlan, chunk: ChunkPlan,
                  op_ids: tuple[int, ...]) -> ChunkCounts:
        src, dst = self.sides(direction)
        return ChunkCounts(copy_calls=copy_chunk_indexed(src, dst, plan, chunk))

    def begin(self, direction: Direction) -> TransferEvent:
        return DoneEvent()

    def record(self, direction: Direction) -> TransferEvent:
        return DoneEvent()

    def elapsed(self, start: TransferEvent, end: TransferEvent) -> float | None:
        if isinstance(start, DoneEvent) and isinstance(end, DoneEvent):
            return max(0.0, end.t - start.t)
        return None

