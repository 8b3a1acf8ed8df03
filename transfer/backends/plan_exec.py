"""The plan-executing fake-asynchronous CPU backend (``"plan-exec"``), for tests.

:class:`~kvtier.transfer.backends.fake_async.FakeAsyncBackend` copies page by page through
the planner's index arrays, so the address tables a kernel or a copy engine executes are
never run on a machine without a GPU. This backend runs them: each chunk issued is turned
into the byte rows ``(source offset, destination offset, bytes)`` of one of the planner's
two table formats, over both pools' unified address spans (``base_ptr``):

- ``mode="runs"``: the flush's :class:`~kvtier.transfer.plan.tables.RunTable`
  (:meth:`Planner.run_table`, what the Numba kernel expands), expanded for the chunk by
  :func:`~kvtier.transfer.plan.tables.expand_run_table`;
- ``mode="rows"``: the chunk's row table (:meth:`Planner.table`, what the copy engine and
  the staging paths execute);
- ``mode="index"``: the parent's page-by-page index copies (the reference).

``piece_bytes`` is small by default (16 bytes), so that runs and rows are split into many
pieces even for the kit's small pages (the splitting is what the tables get wrong).

Like the parent, nothing moves until the test completes a job; the destination pages the
plan names are poisoned meanwhile. At completion the job's rows are executed through a
*scratch* array, as the staging path does: every row's source bytes are gathered into one
contiguous scratch buffer (in a seeded shuffled order of rows), then scattered to their
destinations (in another shuffled order), so a plan whose rows overlap or miss pages does
not happen to work by copying in table order. A row outside either pool's span fails the
job (as a kernel would fault) with :class:`~kvtier.transfer.errors.TransferError`.

Jobs of one stream still complete in issue order (a stream's contract, which the engine's
events rely on); ranks and the two streams interleave as the test likes.
"""

from __future__ import annotations

import random

import numpy as np
import numpy.typing as npt

from kvtier.fsm import ConfigError, Direction

from ..errors import TransferError
from ..plan import ChunkPlan, FlushPlan
from ..plan.tables import expand_run_table
from .base import ChunkCounts
from .fake_async import FakeAsyncBackend, _Job

__all__ = ["PlanExecBackend", "PLAN_MODES"]

#: The copy paths :class:`PlanExecBackend` can execute.
PLAN_MODES = ("runs", "rows", "index")


class PlanExecBackend(FakeAsyncBackend):
    """Fake-asynchronous CPU copies that execute the planner's tables (module docstring).

    Args:
        mode: ``"runs"``, ``"rows"`` or ``"index"`` (:data:`PLAN_MODES`).
        piece_bytes: the tables' largest piece (bytes, a positive multiple of 16).
        seed: seed of the shuffled row orders.
        on_wait: as :class:`FakeAsyncBackend`.

    Raises:
        ConfigError: an unknown ``mode`` or a bad ``piece_bytes``.
    """

    name = "plan-exec"

    def __init__(self, mode: str = "runs", piece_bytes: int = 16, seed: int = 0, on_wait: str = "raise") -> None:
        super().__init__(on_wait=on_wait)
        if mode not in PLAN_MODES:
            raise ConfigError(f"plan-exec backend: mode must be one of {PLAN_MODES}, got {mode!r}")
        if isinstance(piece_bytes, bool) or not isinstance(piece_bytes, int) or piece_bytes <= 0 or piece_bytes % 16:
            raise ConfigError(f"plan-exec backend: piece_bytes must be a positive multiple of 16, got {piece_bytes!r}")
        self.mode = mode
        self.piece_bytes = piece_bytes
        self._rng = random.Random(seed)
        self._rows: dict[int, tuple[Direction, npt.NDArray[np.int64]]] = {}
        self.rows_run = 0  # rows executed so far (how much of the tables ran)

    def chunk_rows(self, direction: Direction, plan: FlushPlan, chunk: ChunkPlan) -> npt.NDArray[np.int64]:
        """The chunk's rows ``[n, 3]`` int64 (source offset, destination offset, bytes) in
        the backend's table format."""
        if self.mode == "runs":
            return expand_run_table(self.planner.run_table(plan, self.piece_bytes), chunk.index)
        return self.planner.table(plan, chunk, self.piece_bytes)

    def run_chunk(self, direction: Direction, plan: FlushPlan, chunk: ChunkPlan,
                  op_ids: tuple[int, ...]) -> ChunkCounts:
        if self.mode == "index" or self._raise_on_issue:
            return super().run_chunk(direction, plan, chunk, op_ids)
        rows = np.array(self.chunk_rows(direction, plan, chunk), dtype=np.int64, copy=True)
        counts = super().run_chunk(direction, plan, chunk, op_ids)  # poisons, queues the job
        job = self._queues[direction][-1]
        job.copies = []  # the rows move the bytes, not the index copies
        self._rows[job.info.job] = (direction, rows)
        return ChunkCounts(copy_calls=int(rows.shape[0]))

    def _execute(self, direction: Direction, rows: npt.NDArray[np.int64]) -> None:
        src_pool, dst_pool = self.sides(direction)
        src_buf, dst_buf = src_pool.single_buffer(), dst_pool.single_buffer()
        if src_buf is None or dst_buf is None:
            raise TransferError("plan-exec backend needs pools that allocated their own buffer")
        src, dst = src_buf.numpy(), dst_buf.numpy()
        if rows.shape[0] == 0:
            return
        s, d, n = rows[:, 0], rows[:, 1], rows[:, 2]
        if (n <= 0).any() or (s < 0).any() or (d < 0).any() or (s + n > src.shape[0]).any() \
                or (d + n > dst.shape[0]).any():
            bad = int(np.flatnonzero((n <= 0) | (s < 0) | (d < 0) | (s + n > src.shape[0])
                                     | (d + n > dst.shape[0]))[0])
            raise TransferError(f"plan-exec backend: row {bad} {rows[bad].tolist()} lies outside the source "
                                f"span ({src.shape[0]} bytes) or the destination span ({dst.shape[0]} bytes)")
        order = list(range(rows.shape[0]))
        self._rng.shuffle(order)
        at = np.zeros(rows.shape[0], dtype=np.int64)
        scratch = np.empty(int(n.sum()), dtype=np.uint8)
        pos = 0
        for i in order:  # gather into the scratch array
            k = int(n[i])
            scratch[pos:pos + k] = src[int(s[i]):int(s[i]) + k]
            at[i] = pos
            pos += k
        self._rng.shuffle(order)
        for i in order:  # scatter from it
            k = int(n[i])
            dst[int(d[i]):int(d[i]) + k] = scratch[int(at[i]):int(at[i]) + k]
        self.rows_run += rows.shape[0]

    def _run(self, job: _Job) -> None:
        entry = self._rows.pop(job.info.job, None)
        if entry is not None and job.fail is None:
            try:
                self._execute(*entry)
            except Exception as e:  # a copy that raises fails its job, never the caller
                job.fail = e
        super()._run(job)
