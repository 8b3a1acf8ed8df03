"""Direct CUDA driver calls for the hot issue path (GPU only): pre-bound kernel launches,
raw events and single copies through ``ctypes``, a few microseconds of host time each.

Issuing a staged piece through the usual Python layers cost about 0.3 ms of host time
on the H200 machine (bench/RESULTS.md, "Staging path and page-major host pool"): a
Numba launch types and marshals its ten arguments on every call, every
``torch.cuda.Event`` is a new object, and a table upload goes through tensor slicing.
Here:

- :class:`BoundKernel` launches the compiled :func:`.kernels.copy_runs` with
  ``cuLaunchKernel``: the parameter words of each array argument are computed once per
  array with Numba's own marshalling (``_Kernel._prepare_args``) and cached, so a
  launch writes 46 integers into a reused parameter block and makes one driver call.
  :meth:`BoundKernel.self_test` checks it against the ordinary launch on a small copy
  when a backend binds; a backend falls back to Numba's launch when it fails.
- :class:`RawEvent`: a ``CUevent`` created once (timing disabled) and re-recorded; its
  :meth:`~RawEvent.done` is ``cuEventQuery``.
- :class:`Driver`: ``cuEventRecord``, ``cuStreamWaitEvent``, ``cuMemcpyAsync`` (unified
  addresses) on raw stream handles.

Every call checks its ``CUresult`` and raises :class:`~kvtier.transfer.errors.TransferError`
naming the call. Nothing here runs under the CUDA simulator (the backends keep their
simulator paths); the GPU tests cover it (``tests/transfer/test_transfer_gpu.py``).
"""

from __future__ import annotations

import ctypes
from typing import Any

from ..errors import BackendUnavailable, TransferError

__all__ = ["Driver", "RawEvent", "BoundKernel", "driver"]

_NOT_READY = 600  # cuda.h: CUDA_ERROR_NOT_READY
_EVENT_DISABLE_TIMING = 2  # cuda.h: CU_EVENT_DISABLE_TIMING


class Driver:
    """The driver entry points used on the issue path (``libcuda.so.1`` through ctypes).

    Raises:
        BackendUnavailable: ``libcuda.so.1`` or one of its symbols is missing.
    """

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            vp, u, sz = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t

            def fn(name: str, *args: Any) -> Any:
                f = getattr(lib, name)
                f.restype = ctypes.c_int
                f.argtypes = list(args)
                return f

            self.launch = fn("cuLaunchKernel", vp, u, u, u, u, u, u, u, vp, vp, vp)
            self.event_create = fn("cuEventCreate", ctypes.POINTER(vp), u)
            self.event_destroy = fn("cuEventDestroy_v2", vp)
            self.event_record = fn("cuEventRecord", vp, vp)
            self.event_query = fn("cuEventQuery", vp)
            self.event_sync = fn("cuEventSynchronize", vp)
            self.stream_wait = fn("cuStreamWaitEvent", vp, vp, u)
            self.memcpy = fn("cuMemcpyAsync", ctypes.c_uint64, ctypes.c_uint64, sz, vp)
            self.kernel_function = fn("cuKernelGetFunction", ctypes.POINTER(vp), vp)
        except (OSError, AttributeError) as e:
            raise BackendUnavailable(f"CUDA driver entry points unavailable: {e}") from e

    @staticmethod
    def check(err: int, what: str) -> None:
        if err != 0:
            raise TransferError(f"{what} returned CUresult {err}")

    def record(self, event: RawEvent, stream: int) -> None:
        """Record ``event`` on ``stream`` (a ``CUstream`` handle)."""
        self.check(self.event_record(event.handle, stream), "cuEventRecord")

    def wait(self, stream: int, event: RawEvent) -> None:
        """Make ``stream`` wait for the last record of ``event``."""
        self.check(self.stream_wait(stream, event.handle, 0), "cuStreamWaitEvent")

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """One ``cuMemcpyAsync`` of ``nbytes`` between unified addresses on ``stream``."""
        self.check(self.memcpy(dst, src, nbytes, stream), f"cuMemcpyAsync of {nbytes} bytes")


_DRIVER: list[Driver] = []


def driver() -> Driver:
    """The process's :class:`Driver` (made at the first call).

    Raises:
        BackendUnavailable: see :class:`Driver`."""
    if not _DRIVER:
        _DRIVER.append(Driver())
    return _DRIVER[0]


class RawEvent:
    """A ``CUevent`` (timing disabled) made once and recorded again at every use; has
    the :class:`~.base.TransferEvent` interface (:meth:`done`, :attr:`error`) and
    :meth:`synchronize`. The event is destroyed with the object."""

    __slots__ = ("handle", "_drv")

    def __init__(self, drv: Driver) -> None:
        h = ctypes.c_void_p()
        drv.check(drv.event_create(ctypes.byref(h), _EVENT_DISABLE_TIMING), "cuEventCreate")
        self.handle = h.value
        self._drv = drv

    def done(self) -> bool:
        err = self._drv.event_query(self.handle)
        if err == _NOT_READY:
            return False
        self._drv.check(err, "cuEventQuery")
        return True

    def synchronize(self) -> None:
        self._drv.check(self._drv.event_sync(self.handle), "cuEventSynchronize")

    @property
    def error(self) -> BaseException | None:
        return None

    def __del__(self) -> None:
        try:
            if self.handle:
                self._drv.event_destroy(self.handle)
        except Exception:  # interpreter shutdown
            pass


#: Parameter words of one 1-D array argument (Numba's data model: meminfo, parent,
#: nitems, itemsize, data, shape, strides).
_ARRAY_WORDS = 7
#: The kernel's arguments: six 1-D arrays, then four int64 scalars.
_ARRAYS, _SCALARS = 6, 4
_WORDS = _ARRAYS * _ARRAY_WORDS + _SCALARS


class BoundKernel:
    """:func:`.kernels.copy_runs` launched with ``cuLaunchKernel`` (see the module docstring).

    Args:
        kernels: the :mod:`.kernels` module.
        sample: a sample of the six array arguments (src32, dst32, src8, dst8, runs,
            refs), used to pick the compiled overload (Numba compiles it if needed).

    Raises:
        BackendUnavailable: the overload's parameter layout is not the one expected
            (six 7-word arrays and four 8-byte scalars), or the driver is missing.
    """

    def __init__(self, kernels: Any, sample: tuple[Any, ...]) -> None:
        self.drv = driver()
        disp = kernels.copy_runs
        args = tuple(sample) + (0, 1, 0, 16)
        argtypes = tuple(disp.typeof_pyval(a) for a in args)
        self._kernel = disp.compile(argtypes)
        self._types = self._kernel.argument_types
        if len(self._types) != _ARRAYS + _SCALARS:
            raise BackendUnavailable(f"copy_runs has {len(self._types)} arguments, expected {_ARRAYS + _SCALARS}")
        cufunc = self._kernel._codelibrary.get_cufunc()
        handle = int(cufunc.handle)  # a cuda.bindings handle: int() is its value
        fn = ctypes.c_void_p()
        # a library kernel (CUkernel): its function in the current context
        if self.drv.kernel_function(ctypes.byref(fn), handle) == 0 and fn.value:
            self.func = fn.value
        else:
            self.func = handle
        self._vals = (ctypes.c_int64 * _WORDS)()
        base = ctypes.addressof(self._vals)
        self._params = (ctypes.c_void_p * _WORDS)(*[base + 8 * i for i in range(_WORDS)])
        self._cache: dict[int, tuple[Any, tuple[int, ...]]] = {}
        for i, a in enumerate(sample):
            self.words(a, i)
        self.launches = 0

    def words(self, arr: Any, position: int = 0) -> tuple[int, ...]:
        """The parameter words of array argument ``arr`` (cached by identity while alive)."""
        hit = self._cache.get(id(arr))
        if hit is not None and hit[0] is arr:
            return hit[1]
        out: list[Any] = []
        self._kernel._prepare_args(self._types[position], arr, 0, [], out)
        w = tuple(int(getattr(x, "value", x) or 0) for x in out)
        if len(w) != _ARRAY_WORDS:
            raise BackendUnavailable(f"copy_runs: an array argument takes {len(w)} parameter words, "
                                     f"expected {_ARRAY_WORDS}")
        if len(self._cache) > 64:
            self._cache.clear()
        self._cache[id(arr)] = (arr, w)
        return w

    def launch(self, src32: Any, dst32: Any, src8: Any, dst8: Any, runs: Any, refs: Any, ref_word: int,
               nrefs: int, items: int, piece: int, blocks: int, threads: int, stream: int) -> None:
        """Launch on ``blocks`` x ``threads`` on ``stream`` (a ``CUstream`` handle); the
        arguments as :func:`.kernels.launch_runs`.

        Raises:
            TransferError: the driver refused the launch."""
        w = self.words
        vals = (w(src32, 0) + w(dst32, 1) + w(src8, 2) + w(dst8, 3) + w(runs, 4) + w(refs, 5)
                + (ref_word, nrefs, items, piece))
        self._vals[:] = vals  # type: ignore[call-overload]
        err = self.drv.launch(self.func, blocks, 1, 1, threads, 1, 1, 0, stream, self._params, None)
        if err != 0:
            raise TransferError(f"cuLaunchKernel of copy_runs ({blocks} x {threads}) returned CUresult {err}")
        self.launches += 1

    def self_test(self, device: Any) -> str | None:
        """Copy a 64 KiB pattern with a bound launch and compare; None when it landed
        exactly, else what differed."""
        import numpy as np
        import torch

        from . import kernels

        src = torch.arange(1 << 14, dtype=torch.int32, device=device).view(torch.uint8)
        dst = torch.zeros_like(src)
        sv = kernels.span_arrays(int(src.data_ptr()), int(src.numel()), src)
        dv = kernels.span_arrays(int(dst.data_ptr()), int(dst.numel()), dst)
        n = int(src.numel())
        # two runs in reverse order, odd piece size: exercises every parameter
        runs = np.array([n // 2, 0, n // 2, 0, n // 2, n // 2], dtype=np.int64)
        refs = np.array([0, 0, 1, 0, 0, -(-(n // 2) // 4096), 1, 1], dtype=np.int64)
        table = torch.from_numpy(np.concatenate([runs, refs])).to(device)
        nb = kernels.device_array(table)
        stream = torch.cuda.current_stream(device)
        self.launch(sv[0], dv[0], sv[1], dv[1], nb, nb, 6, 1, 2 * -(-(n // 2) // 4096), 4096, 2, 256,
                    int(stream.cuda_stream))
        stream.synchronize()
        want = torch.cat([src[n // 2:], src[:n // 2]])
        if not torch.equal(dst, want):
            bad = int((dst != want).nonzero()[0, 0])
            return f"bound launch self-test: byte {bad} differs"
        return None
