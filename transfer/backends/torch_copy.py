"""The ``torch`` backend: one ``copy_`` per contiguous run per tensor ref, on the
transfer streams (the direct path; for when numba-cuda is unusable).

The host pool must be pinned for the copies to be asynchronous. Launch-bound for
small pages: about 4 us per call from Python (``spec/README.md``, Sources: H200 host link and copy costs).
"""

from __future__ import annotations

import torch

from kvtier.fsm import Direction

from ..errors import BackendUnavailable
from ..plan import ChunkPlan, FlushPlan, Planner
from ..pools import DevicePool, HostPool, _Pool
from .base import Backend, ChunkCounts, TransferEvent
from .cuda_streams import CudaStreams

__all__ = ["TorchBackend"]


class TorchBackend(Backend):
    """``copy_(non_blocking=True)`` per contiguous run, on prioritised side streams.

    Args:
        timing: time each flush with CUDA events (default True).
    """

    name = "torch"

    def __init__(self, timing: bool = True) -> None:
        self.timing = timing

    def bind(self, host: HostPool, device: DevicePool, planner: Planner) -> None:
        if device.device.type != "cuda" or not torch.cuda.is_available():
            raise BackendUnavailable(f"backend 'torch' needs a CUDA device pool, got one on {device.device} "
                                     f"(use backend 'cpu' or 'fake-async')")
        super().bind(host, device, planner)
        self.streams = CudaStreams(device.device, self.timing)

    def _sides(self, direction: Direction) -> tuple[_Pool, _Pool]:
        return (self.host, self.device) if direction is Direction.LOADBACK else (self.device, self.host)

    def begin(self, direction: Direction) -> TransferEvent:
        return self.streams.begin(direction)

    def run_chunk(self, direction: Direction, plan: FlushPlan, chunk: ChunkPlan,
                  op_ids: tuple[int, ...]) -> ChunkCounts:
        src_pool, dst_pool = self._sides(direction)
        calls = 0
        with torch.cuda.stream(self.streams.stream(direction)):
            for r in chunk.refs:
                g = plan.groups[r.group_index]
                src = src_pool.region(r.group, r.component, r.layer)
                dst = dst_pool.region(r.group, r.component, r.layer)
                for s, d, n in zip(g.run_src.tolist(), g.run_dst.tolist(), g.run_len.tolist()):
                    dst[d:d + n].copy_(src[s:s + n], non_blocking=True)
                    calls += 1
        return ChunkCounts(copy_calls=calls)

    def record(self, direction: Direction) -> TransferEvent:
        return self.streams.record(direction)

    def wait(self, event: TransferEvent) -> None:
        self.streams.wait(event)

    def elapsed(self, start: TransferEvent, end: TransferEvent) -> float | None:
        return self.streams.elapsed(start, end)

    def synchronize(self) -> None:
        self.streams.synchronize()

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "pinned_host": getattr(self.host, "pinned", None)}
