"""Numba-CUDA copy kernels: the only module of kvtier that imports ``numba.cuda``.

One kernel, :func:`copy_runs`, serves both directions: an H2D scatter (host pages to
device slots) and a D2H gather are the same byte copy. It is driven by a *run table*
(:class:`kvtier.transfer.plan.RunTable`): the flush's contiguous page runs (source page,
destination page, pages), uploaded once per flush, and per launch a few *ref* rows, one
per (group, component, layer) tensor pair (region byte offsets, page size, where its
runs start, how its work items are numbered). The kernel expands runs x refs x pieces
itself, so the host never builds the per-tensor rows. Offsets are relative to one
array view per side; with unified virtual addressing a view from the lowest address
of a pool reaches every region of it, pinned host memory included (zero-copy: the
kernel reads or writes host memory directly over the link).

The kernel is *persistent* and *grid-stride*, so any grid is correct: a team of up to
32 threads (a warp on the GPU) takes work items in turn (item ``team``, then ``team +
teams``, ...). A work item is one piece (default at most 16 KiB) of one run of one
ref, so that work spreads over all teams. Within an item, where source and
destination are equally aligned modulo 16, each lane copies 16-byte words with four
loads in flight before storing (after a byte head up to the alignment, before a byte
tail); equally aligned modulo 4, 4-byte words; otherwise bytes. :func:`launch_copy`
runs a plain row table (source offset, destination offset, bytes) through the same
kernel (tests).

Before numba-cuda is imported, numpy gets ``np.row_stack = np.vstack`` if it lacks it:
numpy 2.5 removed ``row_stack`` and numba-cuda 0.30.4 still registers an overload for it
(seen on the H200 machine; ``spec/README.md``, Sources: numba-cuda and numpy 2.5).

Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the 16-byte accesses are plain
Python on a uint32 view; on the GPU they are one ``ld.global.v4.u32`` /
``st.global.v4.u32`` each (a Numba intrinsic emitting an aligned ``<4 x i32>`` load).
"""

from __future__ import annotations

from typing import Any

import numpy as np

if not hasattr(np, "row_stack"):  # numpy >= 2.5; must precede the numba-cuda import
    np.row_stack = np.vstack

import importlib  # noqa: E402

# numba has no type information: the modules are typed Any here (mypy --strict).
numba: Any = importlib.import_module("numba")
cuda: Any = importlib.import_module("numba.cuda")

__all__ = [
    "SIMULATOR",
    "MAX_THREADS",
    "copy_runs",
    "launch_runs",
    "launch_copy",
    "rows_as_runs",
    "external_stream",
    "span_arrays",
    "device_array",
    "kernel_signatures",
]

#: True when numba runs the CUDA simulator (kernels are Python; no real GPU).
SIMULATOR: bool = bool(numba.config.ENABLE_CUDASIM)

#: Largest block the kernel is compiled for (``launch_bounds``; caps registers at 64).
MAX_THREADS = 1024

ld16: Any
st16: Any

if SIMULATOR:

    def _sim_ld16(a: Any, w: Any) -> tuple[Any, Any, Any, Any]:
        """16-byte word ``w`` of uint32 array ``a`` (simulator: four 4-byte reads)."""
        i = 4 * w
        return (a[i], a[i + 1], a[i + 2], a[i + 3])

    def _sim_st16(a: Any, w: Any, v: tuple[Any, Any, Any, Any]) -> None:
        """Store a 16-byte word (simulator: four 4-byte writes)."""
        i = 4 * w
        a[i] = v[0]
        a[i + 1] = v[1]
        a[i + 2] = v[2]
        a[i + 3] = v[3]

    ld16, st16 = _sim_ld16, _sim_st16
    _JIT_OPTS: dict[str, Any] = {}

else:
    ir: Any = importlib.import_module("llvmlite.ir")
    types: Any = importlib.import_module("numba.core.types")
    intrinsic: Any = importlib.import_module("numba.core.extending").intrinsic

    def _vec_ptr(context: Any, builder: Any, aryty: Any, ary: Any, w: Any) -> Any:
        arr = context.make_array(aryty)(context, builder, ary)
        base = builder.bitcast(arr.data, ir.PointerType(ir.IntType(32)))
        p = builder.gep(base, [builder.mul(w, ir.Constant(w.type, 4))])
        return builder.bitcast(p, ir.PointerType(ir.VectorType(ir.IntType(32), 4)))

    def _ld16(typingctx: Any, a: Any, w: Any) -> Any:  # pragma: no cover - GPU/compile only
        """Load 16-byte word ``w`` of uint32 array ``a`` (one aligned vector load)."""
        sig = types.UniTuple(types.uint32, 4)(a, w)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            ptr = _vec_ptr(context, builder, signature.args[0], args[0], args[1])
            v = builder.load(ptr, align=16)
            tup = context.get_constant_undef(signature.return_type)
            for k in range(4):
                tup = builder.insert_value(tup, builder.extract_element(v, ir.Constant(ir.IntType(32), k)), k)
            return tup

        return sig, codegen

    def _st16(typingctx: Any, a: Any, w: Any, v: Any) -> Any:  # pragma: no cover - GPU/compile only
        """Store a 4-tuple of uint32 as 16-byte word ``w`` of ``a`` (one aligned vector store)."""
        sig = types.void(a, w, v)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            vec = ir.Constant(ir.VectorType(ir.IntType(32), 4), ir.Undefined)
            for k in range(4):
                vec = builder.insert_element(vec, builder.extract_value(args[2], k), ir.Constant(ir.IntType(32), k))
            ptr = _vec_ptr(context, builder, signature.args[0], args[0], args[1])
            builder.store(vec, ptr, align=16)
            return context.get_dummy_value()

        return sig, codegen

    ld16, st16 = intrinsic(_ld16), intrinsic(_st16)
    _JIT_OPTS = {"launch_bounds": MAX_THREADS}


def _copy_runs(src32: Any, dst32: Any, src8: Any, dst8: Any, runs: Any, refs: Any, ref_word: Any,
               nrefs: Any, items: Any, piece: Any) -> None:
    """Copy every work item of a run table (:class:`kvtier.transfer.plan.RunTable`).

    ``runs`` and ``refs`` are 1-D int64 arrays (often the same one): run ``k`` is
    ``runs[3k:3k+3]`` = (source page, destination page, pages); this launch's ``nrefs``
    refs start at word ``ref_word`` of ``refs``, 8 words each = (source region byte
    offset into ``src8``, destination region byte offset into ``dst8``, page bytes,
    first run, first work item, pieces per run, source page stride, destination page
    stride; a run of several pages needs strides equal to the page bytes), first items
    ascending. Work item ``i``
    (``0 <= i < items``) belongs to the last ref whose first item is <= ``i``; with
    ``k = i - first item`` it copies bytes ``[p, p + piece)`` (clipped to the run) of run
    ``first run + k // pieces``, ``p = (k % pieces) * piece``. ``src32``/``dst32`` are
    uint32 views of the same memory as ``src8``/``dst8`` (byte offset ``4*i`` is word
    ``i``). Any grid is correct; teams of ``min(32, blockDim.x)`` threads share an item.

    (One function on purpose: Numba device functions compile for the current device,
    which ``cuda.compile_ptx`` on a machine without a GPU does not have.)"""
    bdim = cuda.blockDim.x
    team = bdim if bdim < 32 else 32
    tid = cuda.blockIdx.x * bdim + cuda.threadIdx.x
    lane = tid % team
    teams = (cuda.gridDim.x * bdim) // team
    r = tid // team
    f = ref_word  # this team's ref: items only increase, so the search only moves forward
    last = ref_word + 8 * (nrefs - 1)
    while r < items:
        while f < last and refs[f + 12] <= r:  # the next ref's first item
            f += 8
        k = r - refs[f + 4]
        ppr = refs[f + 5]
        q = k
        off = k - k  # 0, typed like k
        if ppr != 1:  # 32-bit division (items < 2**31, plan.MAX_CHUNK_ITEMS): inline code; the
            # 64-bit division routine made ptxas spill at the 64-register cap of 1024 threads
            q = numba.int64(numba.uint32(k) // numba.uint32(ppr))
            off = (k - q * ppr) * piece
        run = 3 * (refs[f + 3] + q)
        pb = refs[f + 2]
        n = runs[run + 2] * pb - off
        if n > piece:
            n = piece
        s = refs[f] + runs[run] * refs[f + 6] + off
        d = refs[f + 1] + runs[run + 1] * refs[f + 7] + off
        if (s & 15) == (d & 15):
            w = 16
        elif (s & 3) == (d & 3):
            w = 4
        else:
            w = 1
        head = (w - (s & (w - 1))) & (w - 1)
        if head > n:
            head = n
        words = (n - head) // w
        body_end = head + words * w
        c = lane
        while c < head:  # bytes up to the alignment
            dst8[d + c] = src8[s + c]
            c += team
        if w == 16:
            sw = (s + head) >> 4
            dw = (d + head) >> 4
            x = lane
            while x + 3 * team < words:  # four 16-byte loads in flight per lane
                a = ld16(src32, sw + x)
                b = ld16(src32, sw + x + team)
                e = ld16(src32, sw + x + 2 * team)
                g = ld16(src32, sw + x + 3 * team)
                st16(dst32, dw + x, a)
                st16(dst32, dw + x + team, b)
                st16(dst32, dw + x + 2 * team, e)
                st16(dst32, dw + x + 3 * team, g)
                x += 4 * team
            while x < words:
                st16(dst32, dw + x, ld16(src32, sw + x))
                x += team
        elif w == 4:
            sw = (s + head) >> 2
            dw = (d + head) >> 2
            x = lane
            while x < words:
                dst32[dw + x] = src32[sw + x]
                x += team
        else:
            c = head + lane
            while c < body_end:
                dst8[d + c] = src8[s + c]
                c += team
        c = body_end + lane
        while c < n:  # bytes after the last whole word
            dst8[d + c] = src8[s + c]
            c += team
        r += teams


copy_runs: Any = cuda.jit(**_JIT_OPTS)(_copy_runs)


def launch_runs(src32: Any, dst32: Any, src8: Any, dst8: Any, runs: Any, refs: Any, ref_word: int,
                nrefs: int, items: int, piece: int, blocks: int, threads: int, stream: Any = 0) -> None:
    """Launch :func:`copy_runs` on ``blocks`` x ``threads`` (threads <= 1024) on ``stream``."""
    copy_runs[blocks, threads, stream](src32, dst32, src8, dst8, runs, refs, ref_word, nrefs, items, piece)


def rows_as_runs(table: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """A row table (int64 ``[rows, 3]``: source offset, destination offset, bytes) as
    (runs, refs, piece) for :func:`copy_runs`: one ref of 1-byte pages, one run per row,
    one piece per run (host side; NumPy)."""
    table = np.ascontiguousarray(table, dtype=np.int64).reshape(-1, 3)
    longest = int(table[:, 2].max()) if table.shape[0] else 0
    piece = max(16, -(-longest // 16) * 16)
    refs = np.array([0, 0, 1, 0, 0, 1, 1, 1], dtype=np.int64)
    return table.reshape(-1), refs, piece


def launch_copy(src32: Any, dst32: Any, src8: Any, dst8: Any, table: np.ndarray, blocks: int, threads: int,
                stream: Any = 0) -> None:
    """Copy the rows of a host row table (see :func:`rows_as_runs`) with :func:`copy_runs`
    (tests and tools; the table is handed to the launch as it is)."""
    runs, refs, piece = rows_as_runs(table)
    rows = int(table.shape[0])
    put = device_array if SIMULATOR else cuda.to_device
    copy_runs[blocks, threads, stream](src32, dst32, src8, dst8, put(runs), put(refs), 0, 1, rows, piece)


def external_stream(ptr: int) -> Any:
    """A Numba stream wrapping a CUDA stream handle (e.g. ``torch_stream.cuda_stream``)."""
    return cuda.external_stream(ptr)


class _Span:
    """An object exposing ``__cuda_array_interface__`` for ``nbytes`` bytes at ``ptr``."""

    def __init__(self, ptr: int, nbytes: int, typestr: str, itemsize: int, owner: object) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes // itemsize,),
            "strides": None,
            "typestr": typestr,
            "data": (ptr, False),
            "version": 3,
        }


def span_arrays(ptr: int, nbytes: int, owner: object) -> tuple[Any, Any]:
    """(uint32 view, uint8 view) Numba device arrays of ``nbytes`` at ``ptr`` (16-byte
    aligned; device memory or mapped pinned host memory). ``owner`` is kept alive by
    the views; nothing is copied or synchronised."""
    if ptr % 16 or nbytes % 16:
        raise ValueError(f"span must be 16-byte aligned, got ptr={ptr:#x} nbytes={nbytes}")
    u32 = cuda.as_cuda_array(_Span(ptr, nbytes, "<u4", 4, owner), sync=False)
    u8 = cuda.as_cuda_array(_Span(ptr, nbytes, "|u1", 1, owner), sync=False)
    return u32, u8


def span_array_i64(ptr: int, nbytes: int, owner: object) -> Any:
    """An int64 Numba device array of ``nbytes`` at ``ptr`` (8-byte aligned; device
    memory or mapped pinned host memory, e.g. a run table the kernel reads in place);
    ``owner`` is kept alive by the view; nothing is copied."""
    if ptr % 8 or nbytes % 8:
        raise ValueError(f"span must be 8-byte aligned, got ptr={ptr:#x} nbytes={nbytes}")
    return cuda.as_cuda_array(_Span(ptr, nbytes, "<i8", 8, owner), sync=False)


def device_array(obj: Any) -> Any:
    """A Numba view of a CUDA tensor (or any ``__cuda_array_interface__`` object).

    Under the simulator: a NumPy array wrapped without a copy, so that several views of
    one buffer (the uint8 and uint32 views a launch takes) alias as they do on a GPU
    (the simulator copies plain NumPy arguments in and out one by one, and the last
    copy-out would win)."""
    if SIMULATOR:
        sim: Any = importlib.import_module("numba.cuda.simulator.cudadrv.devicearray")
        return sim.FakeCUDAArray(obj)
    return cuda.as_cuda_array(obj, sync=False)


def kernel_signatures() -> dict[str, tuple[Any, Any, dict[str, Any]]]:
    """Every kernel as ``name -> (python function, signature, compile options)`` for
    ``cuda.compile_ptx`` (the CI compile check for sm_90)."""
    t: Any = importlib.import_module("numba.core.types")

    u32 = t.Array(t.uint32, 1, "C")
    u8 = t.Array(t.uint8, 1, "C")
    words = t.Array(t.int64, 1, "C")
    sig = (u32, u32, u8, u8, words, words, t.int64, t.int64, t.int64, t.int64)
    return {"copy_runs": (copy_runs.py_func, sig, dict(_JIT_OPTS))}
