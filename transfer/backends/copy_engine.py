"""Batched copies: many scattered byte ranges in one call.

:class:`DriverBatchCopier` hands them to the GPU's copy engines with one
``cuMemcpyBatchAsync`` call (CUDA driver 12.8 and later) per batch: the descriptor
arrays are NumPy ``uint64`` arrays passed by address through ``ctypes``, so a batch
costs no Python object per copy (cuda-python's own wrapper of the call takes one
``CUdeviceptr`` object per address). The entry point is looked up with
``cuGetProcAddress`` from ``cuda.bindings`` for the CUDA 12.8 signature (with
``failIdx``; CUDA 13 keeps it under that version and adds ``cuMemcpyBatchAsync_v2``
without it), or, without ``cuda.bindings``, as the exported symbol of
``libcuda.so.1``.

:class:`HostBatchCopier` performs the same batches with ``memmove`` on host addresses:
the hybrid backend's copy-engine path on CPU pools (tests, the CUDA simulator).
"""

from __future__ import annotations

import ctypes
import importlib
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.fsm import Direction

from ..errors import BackendUnavailable, TransferError

__all__ = ["BatchCopier", "DriverBatchCopier", "HostBatchCopier", "MAX_BATCH"]

U64 = npt.NDArray[np.uint64]

#: Most copies per driver call; longer batches are split.
MAX_BATCH = 1 << 16

_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1  # cuda.h: CUmemcpySrcAccessOrder
_CU_MEM_LOCATION_TYPE_DEVICE = 1  # cuda.h: CUmemLocationType
_CU_MEM_LOCATION_TYPE_HOST = 2


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """cuda.h ``CUmemcpyAttributes`` (CUDA 12.8+)."""

    _fields_ = [("srcAccessOrder", ctypes.c_uint), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


class _Memcpy2D(ctypes.Structure):
    """cuda.h ``CUDA_MEMCPY2D``."""

    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_uint),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t), ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
                ("dstMemoryType", ctypes.c_uint), ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64),
                ("dstArray", ctypes.c_void_p), ("dstPitch", ctypes.c_size_t), ("WidthInBytes", ctypes.c_size_t),
                ("Height", ctypes.c_size_t)]


_CU_MEMORYTYPE_UNIFIED = 4  # cuda.h: CUmemorytype (an address of the unified address space)
_COPY2D_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)

_BATCH_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p)


class BatchCopier(ABC):
    """Issues batches of byte copies (absolute addresses) on a stream."""

    #: Reported in the statistics.
    name: str = "?"

    @abstractmethod
    def copy(self, direction: Direction, dst: U64, src: U64, sizes: U64, stream: int) -> int:
        """Copy ``sizes[i]`` bytes from ``src[i]`` to ``dst[i]`` for every ``i`` (uint64
        ``[n]`` C-contiguous arrays), in the order of ``stream`` (a ``CUstream``
        handle, 0 for none). Returns the number of calls made.

        Raises:
            TransferError: the copy could not be issued."""

    def copy2d(self, direction: Direction, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
               rows: int, stream: int) -> int:
        """Copy ``rows`` rows of ``width`` bytes from ``src`` (rows ``src_pitch`` bytes
        apart) to ``dst`` (``dst_pitch`` apart), absolute addresses, in the order of
        ``stream``. Returns the number of calls made. Default: one copy per row."""
        if rows <= 0 or width <= 0:
            return 0
        r = np.arange(rows, dtype=np.uint64)
        return self.copy(direction, np.uint64(dst) + r * np.uint64(dst_pitch),
                         np.uint64(src) + r * np.uint64(src_pitch), np.full(rows, width, dtype=np.uint64), stream)


class DriverBatchCopier(BatchCopier):
    """``cuMemcpyBatchAsync`` through ``ctypes`` (see the module docstring).

    Args:
        device_index: the CUDA device of the device pool (its location hint).

    Raises:
        BackendUnavailable: the driver has no ``cuMemcpyBatchAsync`` (older than 12.8).
    """

    name = "cuMemcpyBatchAsync"

    def __init__(self, device_index: int) -> None:
        self.fn = self._lookup()
        self.attrs = {}
        for d in (Direction.LOADBACK, Direction.WRITEBACK):
            host = _MemLocation(_CU_MEM_LOCATION_TYPE_HOST, 0)
            dev = _MemLocation(_CU_MEM_LOCATION_TYPE_DEVICE, device_index)
            src, dst = (host, dev) if d is Direction.LOADBACK else (dev, host)
            self.attrs[d] = _MemcpyAttributes(_CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, src, dst, 0)
        self._idx = ctypes.c_size_t(0)
        self._fail = ctypes.c_size_t(0)
        self.fn2d: Any = None
        try:
            ptr = ctypes.cast(ctypes.CDLL("libcuda.so.1").cuMemcpy2DAsync_v2, ctypes.c_void_p).value
            self.fn2d = _COPY2D_FN(ptr) if ptr else None
        except (OSError, AttributeError, TypeError):  # pitched copies fall back to one copy per row
            self.fn2d = None
        self._m2d = _Memcpy2D()

    @staticmethod
    def _lookup() -> Any:
        errors: list[str] = []
        try:
            drv: Any = importlib.import_module("cuda.bindings.driver")
            res = drv.cuGetProcAddress(b"cuMemcpyBatchAsync", 12080, 0)
            if res[0] == drv.CUresult.CUDA_SUCCESS and int(res[1]):
                return _BATCH_FN(int(res[1]))
            errors.append(f"cuGetProcAddress: {res[0]}")
        except Exception as e:  # no cuda.bindings: the exported symbol (12.8 signature)
            errors.append(f"cuda.bindings: {e}")
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            ptr = ctypes.cast(lib.cuMemcpyBatchAsync, ctypes.c_void_p).value
            if ptr:
                return _BATCH_FN(ptr)
            errors.append("libcuda.so.1: cuMemcpyBatchAsync is NULL")
        except (OSError, AttributeError) as e:
            errors.append(f"libcuda.so.1: {e}")
        raise BackendUnavailable("copy engines: no cuMemcpyBatchAsync (CUDA driver 12.8 or later needed): "
                                 + "; ".join(errors))

    def copy(self, direction: Direction, dst: U64, src: U64, sizes: U64, stream: int) -> int:
        n = int(sizes.shape[0])
        attr = ctypes.byref(self.attrs[direction])
        calls = 0
        for at in range(0, n, MAX_BATCH):
            k = min(MAX_BATCH, n - at)
            err = self.fn(dst.ctypes.data + 8 * at, src.ctypes.data + 8 * at, sizes.ctypes.data + 8 * at, k, attr,
                          ctypes.byref(self._idx), 1, ctypes.byref(self._fail), stream)
            calls += 1
            if err != 0:
                raise TransferError(f"cuMemcpyBatchAsync returned CUresult {err} for {k} copies "
                                    f"(first failing copy {self._fail.value} of that call)")
        return calls


    def copy2d(self, direction: Direction, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int,
               rows: int, stream: int) -> int:
        """One ``cuMemcpy2DAsync`` (both sides unified addresses)."""
        if rows <= 0 or width <= 0:
            return 0
        if self.fn2d is None:
            return super().copy2d(direction, dst, dst_pitch, src, src_pitch, width, rows, stream)
        m = self._m2d
        m.srcMemoryType = m.dstMemoryType = _CU_MEMORYTYPE_UNIFIED
        m.srcDevice, m.srcPitch, m.dstDevice, m.dstPitch = src, src_pitch, dst, dst_pitch
        m.WidthInBytes, m.Height = width, rows
        err = self.fn2d(ctypes.addressof(m), stream)
        if err != 0:
            raise TransferError(f"cuMemcpy2DAsync returned CUresult {err} for {rows} rows of {width} bytes "
                                f"(pitches {src_pitch} -> {dst_pitch})")
        return 1


class HostBatchCopier(BatchCopier):
    """The same batches with ``ctypes.memmove`` on host addresses, synchronously (CPU
    pools: tests and the CUDA simulator; ``stream`` is ignored)."""

    name = "memmove"

    def copy(self, direction: Direction, dst: U64, src: U64, sizes: U64, stream: int) -> int:
        for d, s, n in zip(dst.tolist(), src.tolist(), sizes.tolist()):
            ctypes.memmove(d, s, n)
        return 1 if sizes.shape[0] else 0
