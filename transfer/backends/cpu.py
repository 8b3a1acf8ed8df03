"""The ``cpu`` backend: synchronous index copies with torch on CPU tensors.

For machines without a GPU (and as the reference the other backends are tested
against). Both pools must be CPU pools; every copy has finished when
:meth:`CpuBackend.run_chunk` returns.
"""

from __future__ import annotations

from kvtier.fsm import Direction

from ..errors import BackendUnavailable
from ..plan import ChunkPlan, ChunkRef, FlushPlan, Planner
from ..pools import DevicePool, HostPool, _Pool, put_layers, take_layers
from .base import Backend, ChunkCounts, DoneEvent, TransferEvent

__all__ = ["CpuBackend", "copy_chunk_indexed"]


def copy_chunk_indexed(src_pool: _Pool, dst_pool: _Pool, plan: FlushPlan, chunk: ChunkPlan) -> int:
    """Copy every ref of ``chunk`` by index arrays: for each (group, component), the
    chunk's layers of that component in one indexed gather + indexed store over the
    pools' ``[layers, pages, page_bytes]`` views (:meth:`_Pool.layer_view`) when its
    layers are consecutive in the group's spec, else one pair per ref.

    Returns the number of copy calls."""
    calls = 0
    by_tensor: dict[tuple[int, str], list[ChunkRef]] = {}
    for r in chunk.refs:
        by_tensor.setdefault((r.group_index, r.component), []).append(r)
    for (gi, comp), refs in by_tensor.items():
        g = plan.groups[gi]
        s_idx, d_idx = g.index_tensors()
        group = refs[0].group
        span = _layer_span(src_pool, group, [r.layer for r in refs])
        src_v = src_pool.layer_view(group, comp) if span is not None else None
        dst_v = dst_pool.layer_view(group, comp) if src_v is not None else None
        if span is not None and src_v is not None and dst_v is not None:
            lo, hi = span
            put_layers(dst_v[lo:hi], d_idx, take_layers(src_v[lo:hi], s_idx))
            calls += 1
            continue
        for r in refs:
            src = src_pool.region(r.group, r.component, r.layer)
            dst = dst_pool.region(r.group, r.component, r.layer)
            dst.index_copy_(0, d_idx, src.index_select(0, s_idx))
            calls += 1
    return calls


def _layer_span(pool: _Pool, group: str, layers: list[int]) -> tuple[int, int] | None:
    """``(lo, hi)``: the positions of ``layers`` in the group's spec when consecutive."""
    spec_layers = pool.specs[group].layers
    try:
        lo = spec_layers.index(layers[0])
    except ValueError:
        return None
    hi = lo + len(layers)
    return (lo, hi) if tuple(layers) == spec_layers[lo:hi] else None


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

