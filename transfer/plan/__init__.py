"""Coalesced transfer plans and their caches.

All commands of one direction queued in one flush are merged per (group, layers) and
contiguous runs (both source and destination advancing by one page) found. When no
destination page repeats (checked in O(n) with a scratch array: the common case) the
pairs keep the order given and nothing is sorted; otherwise they are de-duplicated and
sorted by (source, destination) first. A destination page that two
different source pages would write is a conflict: every command holding such a pair
is rejected (it fails; the others go on). The plan is cut into layer chunks (a
loadback in chunks of ``chunk_layers`` model layers, so the forward pass can start
on early layers; a writeback in one chunk), and each chunk lists its *tensor refs*,
one per (group, component, layer).

Two caches: the per-(direction, group, layers) *address tables* (region byte offsets
and page sizes: they do not change between flushes) are built once; and whole plans,
keyed by the identity of the commands' :class:`GroupTransfer` objects, are kept in a
small LRU, so resubmitting the same transfer objects re-uses the coalesced plan and
whatever a backend cached on the plan and its chunks (e.g. the Numba backend's
device-side table).

Two table formats describe a plan's byte copies over both pools' unified address spans:

- :meth:`Planner.table`, *rows*: one ``(source offset, destination offset, bytes)`` row
  per contiguous run per tensor ref, split into pieces (the reference format; its size
  is spans x refs rows).
- :meth:`Planner.run_table`, *runs*: each group's runs once per flush (``(source page,
  destination page, pages)``), plus per chunk one small row per tensor ref (region
  offsets, page size, where its runs start, how its work items are numbered); the
  Numba kernel expands runs x refs x pieces itself, so the host builds and uploads
  spans + refs rows instead of spans x refs. :func:`expand_run_table` is the same
  expansion in NumPy (tests).

Modules: :mod:`.records` (what a plan is: :class:`FlushPlan`, :class:`GroupPlan`,
:class:`ChunkPlan`, :class:`ChunkRef`), :mod:`.planner` (:class:`Planner`: merging,
chunking, the caches, building the tables) and :mod:`.tables` (the two table formats).
"""

from __future__ import annotations

from .planner import Planner
from .records import I64, ChunkPlan, ChunkRef, Command, FlushPlan, GroupPlan, layers_for
from .tables import (
    DEFAULT_PIECE_BYTES,
    MAX_CHUNK_ITEMS,
    REF_COLS,
    REF_DST_STRIDE,
    REF_SRC_STRIDE,
    REF_DST,
    REF_ITEM0,
    REF_PAGE_BYTES,
    REF_PIECES,
    REF_RUN0,
    REF_SRC,
    RUN_COLS,
    RunTable,
    expand_run_table,
    split_rows,
    split_runs,
)

__all__ = ["GroupPlan", "ChunkRef", "ChunkPlan", "Command", "I64", "FlushPlan", "Planner", "RunTable", "layers_for",
           "split_rows", "split_runs", "expand_run_table", "DEFAULT_PIECE_BYTES", "MAX_CHUNK_ITEMS", "RUN_COLS",
           "REF_COLS", "REF_SRC", "REF_DST", "REF_PAGE_BYTES", "REF_RUN0", "REF_ITEM0", "REF_PIECES",
           "REF_SRC_STRIDE", "REF_DST_STRIDE"]
