"""kvtier's transfer engine: moves pages between the device (L1) and host (L2) pools.

It executes the :class:`~kvtier.fsm.TransferCommand` records the core returns and turns
what happened into :class:`~kvtier.fsm.Completion` records, polled on the scheduler's
thread. Importing this package imports torch but not numba: numba-cuda is imported
only when the ``numba`` backend is used (or chosen automatically on a real GPU).

Public API:
    :class:`TransferEngine` (``submit``, ``flush``, ``poll_completions``, ``wait_layer``,
    ``stats``), the array records :class:`ArrayCommand` and :class:`PageArrays`,
    :class:`HostPool`, :class:`DevicePool`, :func:`pages_for_budget`, the backends
    (:class:`CpuBackend`, :class:`FakeAsyncBackend`, :class:`TorchBackend`,
    :class:`NumbaBackend`, :class:`HybridBackend` with its :class:`Calibration` and
    batch copiers, :func:`make_backend`, :func:`choose_backend`) and the errors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .arrays import ArrayCommand, PageArrays
from .backends import BACKENDS, Backend, ChunkCounts, DoneEvent, TransferEvent, choose_backend, make_backend
from .backends.copy_engine import BatchCopier, DriverBatchCopier, HostBatchCopier
from .backends.cpu import CpuBackend
from .backends.fake_async import POISON_BYTE, FakeAsyncBackend, PendingCopy
from .backends.hybrid_choice import Calibration
from .engine import TransferEngine
from .errors import (
    BackendUnavailable,
    HazardError,
    HostMemoryError,
    NotReadyError,
    PoisonedReadError,
    TransferError,
)
from .plan import ChunkPlan, FlushPlan, GroupPlan, Planner
from .pools import DevicePool, HostPool, RegionKey, available_host_bytes, pages_for_budget
from .stats import DirectionStats

if TYPE_CHECKING:
    from .backends.hybrid import HybridBackend
    from .backends.numba_sm import NumbaBackend
    from .backends.torch_copy import TorchBackend

__all__ = [
    "ArrayCommand",
    "BACKENDS",
    "BatchCopier",
    "Calibration",
    "DriverBatchCopier",
    "HostBatchCopier",
    "HybridBackend",
    "PageArrays",
    "Backend",
    "BackendUnavailable",
    "ChunkCounts",
    "ChunkPlan",
    "CpuBackend",
    "DevicePool",
    "DirectionStats",
    "DoneEvent",
    "FakeAsyncBackend",
    "FlushPlan",
    "GroupPlan",
    "HazardError",
    "HostMemoryError",
    "HostPool",
    "NotReadyError",
    "NumbaBackend",
    "POISON_BYTE",
    "PendingCopy",
    "Planner",
    "PoisonedReadError",
    "RegionKey",
    "TorchBackend",
    "TransferEngine",
    "TransferError",
    "TransferEvent",
    "available_host_bytes",
    "choose_backend",
    "make_backend",
    "pages_for_budget",
]


def __getattr__(name: str) -> Any:
    # The CUDA backends are imported on first use (NumbaBackend's module itself does
    # not import numba; its bind() does).
    if name == "NumbaBackend":
        from .backends.numba_sm import NumbaBackend

        return NumbaBackend
    if name == "HybridBackend":
        from .backends.hybrid import HybridBackend

        return HybridBackend
    if name == "TorchBackend":
        from .backends.torch_copy import TorchBackend

        return TorchBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
