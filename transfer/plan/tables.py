"""The copy tables of a plan over both pools' unified address spans, and their checks.

Two formats (built by :meth:`Planner.table <kvtier.transfer.plan.planner.Planner.table>` and
:meth:`Planner.run_table <kvtier.transfer.plan.planner.Planner.run_table>`):

- *rows*: one ``(source offset, destination offset, bytes)`` row per contiguous run per
  tensor ref, split into pieces (:func:`split_rows`);
- *runs* (:class:`RunTable`): each group's runs once per flush (split by
  :func:`split_runs`), plus per chunk one small row per tensor ref; the Numba kernel
  expands runs x refs x pieces itself, and :func:`expand_run_table` is the same
  expansion in NumPy (tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtier.fsm import ConfigError

from .records import I64

__all__ = ["RunTable", "split_rows", "split_runs", "expand_run_table", "DEFAULT_PIECE_BYTES", "MAX_CHUNK_ITEMS",
           "RUN_COLS", "REF_COLS", "REF_SRC", "REF_DST", "REF_PAGE_BYTES", "REF_RUN0", "REF_ITEM0", "REF_PIECES",
           "REF_SRC_STRIDE", "REF_DST_STRIDE"]

#: Default largest piece (bytes) of one table row; longer runs are split so that the
#: work spreads over all warps of a persistent kernel.
DEFAULT_PIECE_BYTES = 16384

#: Work items of one chunk must stay below this (the kernel divides item numbers in 32 bits).
MAX_CHUNK_ITEMS = 1 << 31

#: int64 words per run of a :class:`RunTable`: (source page, destination page, pages).
RUN_COLS = 3
#: int64 words per tensor ref of a :class:`RunTable`: (source region offset, destination
#: region offset, page bytes, index of the group's first run, index of the ref's first
#: work item in the chunk, work items (pieces) per run, source and destination page
#: strides in bytes: page bytes in a layer-first region; where a stride differs from
#: the page bytes, runs are single pages).
REF_COLS = 8
REF_SRC, REF_DST, REF_PAGE_BYTES, REF_RUN0, REF_ITEM0, REF_PIECES, REF_SRC_STRIDE, REF_DST_STRIDE = range(REF_COLS)


@dataclass(eq=False)
class RunTable:
    """A flush's copies in the *run* format that the Numba kernel expands itself.

    Everything lives in one int64 buffer, :attr:`packed` (one upload per flush): first
    every group's runs (:data:`RUN_COLS` words each: source page, destination page,
    pages; a group's runs are split to at most ``seg_pages`` pages, so that with
    ``pieces`` work items per run no item copies more than ``piece_bytes``), then each
    chunk's tensor refs (:data:`REF_COLS` words each: source and destination region
    offsets from the pools' ``base_ptr``, page bytes, index of the group's first run,
    index of the ref's first work item in the chunk, pieces per run, source and
    destination page strides).

    Work item ``i`` of a chunk belongs to the last ref whose first item is <= ``i``;
    with ``k = i - first item``, it copies piece ``k % pieces`` (``piece_bytes`` bytes
    at most) of run ``first run + k // pieces`` of that ref.

    Attributes:
        piece_bytes: largest byte range of one work item (a multiple of 16).
        packed: the int64 buffer (1-D, C-contiguous).
        runs: int64 ``[R, RUN_COLS]`` view of :attr:`packed`.
        run0: per group plan, index of its first run.
        seg_pages: per group plan, most pages per run after splitting.
        chunk_refs: per chunk, int64 ``[refs, REF_COLS]`` view of :attr:`packed`.
        chunk_ref_word: per chunk, word index of its first ref in :attr:`packed`.
        chunk_items: per chunk, its work items.
    """

    piece_bytes: int
    packed: I64
    runs: I64
    run0: tuple[int, ...]
    seg_pages: tuple[int, ...]
    chunk_refs: tuple[I64, ...]
    chunk_ref_word: tuple[int, ...]
    chunk_items: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of :attr:`packed` (what is uploaded per flush)."""
        return int(self.packed.nbytes)


def split_runs(run_src: I64, run_dst: I64, run_len: I64, max_pages: int) -> tuple[I64, I64, I64]:
    """Split runs (source page, destination page, pages) longer than ``max_pages`` (>= 1)
    into consecutive runs of at most ``max_pages`` pages."""
    if max_pages <= 0:
        raise ConfigError(f"max_pages must be positive, got {max_pages!r}")
    if run_len.shape[0] == 0 or int(run_len.max()) <= max_pages:
        return run_src, run_dst, run_len
    k = (run_len + max_pages - 1) // max_pages
    idx = np.repeat(np.arange(run_len.shape[0]), k)
    first = np.repeat(np.cumsum(k) - k, k)
    within = (np.arange(idx.shape[0], dtype=np.int64) - first) * max_pages
    return (run_src[idx] + within, run_dst[idx] + within,
            np.minimum(max_pages, run_len[idx] - within).astype(np.int64))


def expand_run_table(rt: RunTable, chunk_index: int) -> I64:
    """The rows ``(source offset, destination offset, bytes)`` that the kernel copies
    for one chunk of a run table, in work-item order (NumPy; for tests and tools)."""
    refs = rt.chunk_refs[chunk_index]
    items = rt.chunk_items[chunk_index]
    out = np.empty((items, 3), dtype=np.int64)
    i = np.arange(items, dtype=np.int64)
    ref = np.searchsorted(refs[:, REF_ITEM0], i, side="right") - 1
    r = refs[ref]
    k = i - r[:, REF_ITEM0]
    q, piece = np.divmod(k, r[:, REF_PIECES])
    run = rt.runs[r[:, REF_RUN0] + q]
    pb = r[:, REF_PAGE_BYTES]
    off = piece * rt.piece_bytes
    out[:, 0] = r[:, REF_SRC] + run[:, 0] * r[:, REF_SRC_STRIDE] + off
    out[:, 1] = r[:, REF_DST] + run[:, 1] * r[:, REF_DST_STRIDE] + off
    out[:, 2] = np.minimum(rt.piece_bytes, run[:, 2] * pb - off)
    return out


def split_rows(rows: I64, piece_bytes: int) -> I64:
    """Split rows (src, dst, nbytes) longer than ``piece_bytes`` (a positive multiple
    of 16) into pieces of at most ``piece_bytes``; returns a C-contiguous int64 array."""
    if piece_bytes <= 0 or piece_bytes % 16:
        raise ConfigError(f"piece_bytes must be a positive multiple of 16, got {piece_bytes!r}")
    n = rows[:, 2]
    if rows.shape[0] == 0 or int(n.max()) <= piece_bytes:
        return np.ascontiguousarray(rows, dtype=np.int64)
    k = (n + piece_bytes - 1) // piece_bytes
    idx = np.repeat(np.arange(rows.shape[0]), k)
    first = np.repeat(np.cumsum(k) - k, k)
    within = (np.arange(idx.shape[0]) - first) * piece_bytes
    out = np.empty((idx.shape[0], 3), dtype=np.int64)
    out[:, 0] = rows[idx, 0] + within
    out[:, 1] = rows[idx, 1] + within
    out[:, 2] = np.minimum(piece_bytes, n[idx] - within)
    return out
