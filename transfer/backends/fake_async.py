"""The fake-asynchronous CPU backend (``"fake-async"``), for tests.

It behaves like two CUDA streams (loadback and writeback) that the test drives by
hand: every chunk a flush issues becomes a *pending copy* (a job) on its direction's
stream, and does nothing until the test completes it (:meth:`~FakeAsyncBackend.complete_next`,
:meth:`~FakeAsyncBackend.complete`, :meth:`~FakeAsyncBackend.complete_all`). Jobs of
one stream complete in issue order (completing one completes its predecessors
first); the two streams interleave in any order. Until its job completes, every
destination page is *poisoned* (each byte :data:`POISON_BYTE`), and the bytes are
read from the source only at completion, as a real stream would.

Misuse is caught with a clear error, as a race would corrupt data on a GPU:
- a flush whose copies touch a page that a pending copy on the *other* stream reads or
  writes raises :class:`HazardError` from :meth:`TransferEngine.flush` before anything is
  issued (same-stream reuse is ordered by the stream and allowed);
- :meth:`~FakeAsyncBackend.check_read` raises :class:`PoisonedReadError` for a page
  that a pending copy still writes, :meth:`~FakeAsyncBackend.check_write` raises
  :class:`HazardError` for a page a pending copy reads or writes;
- ``wait_layer`` for a layer whose chunk is pending raises :class:`NotReadyError`
  (or, with ``on_wait="complete"``, completes that stream up to the chunk).

A copy the core gave up on (its deadline passed) is not special here: the test completes
it whenever it likes, after the deadline too, and the engine then acknowledges it late;
``TransferEngine.cancel(op, wait=True)`` completes its stream up to the op's last chunk.

Failures can be injected: :meth:`~FakeAsyncBackend.fail_next` makes a pending copy
fail when it completes (its destination stays poisoned), and
:meth:`~FakeAsyncBackend.raise_on_issue` makes the next chunk raise when issued.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from kvtier.fsm import ConfigError, Direction

from ..errors import HazardError, NotReadyError, PoisonedReadError, TransferError
from ..plan import ChunkPlan, FlushPlan
from .base import ChunkCounts, TransferEvent
from .cpu import CpuBackend

__all__ = ["POISON_BYTE", "PendingCopy", "FakeAsyncBackend", "FakeEvent", "InjectedFailure"]

#: Every byte of a destination page reads this value until its copy completes.
POISON_BYTE = 0xDE

_Access = dict[tuple[str, str, int], npt.NDArray[np.int64]]


class InjectedFailure(TransferError):
    """The failure :meth:`FakeAsyncBackend.fail_next` injects by default."""


@dataclass(frozen=True, slots=True)
class PendingCopy:
    """One issued chunk that has not completed.

    Attributes:
        job: issue number (global, increasing).
        stream: the stream it runs on (its direction).
        op_ids: operations whose pages it copies (all ops of the flush's direction).
        chunk: chunk index within its flush.
        layers: model layers it copies.
    """

    job: int
    stream: Direction
    op_ids: tuple[int, ...]
    chunk: int
    layers: tuple[int, ...]


@dataclass(eq=False)
class _Job:
    info: PendingCopy
    copies: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    writes: _Access
    reads: _Access
    fail: BaseException | None = None
    error: BaseException | None = field(default=None)


class FakeEvent:
    """Done once every job issued on ``stream`` up to ``job`` has completed."""

    __slots__ = ("_backend", "stream", "job")

    def __init__(self, backend: FakeAsyncBackend, stream: Direction, job: int) -> None:
        self._backend = backend
        self.stream = stream
        self.job = job

    def done(self) -> bool:
        q = self._backend._queues[self.stream]
        return not q or q[0].info.job > self.job

    @property
    def error(self) -> BaseException | None:
        return self._backend._errors.get(self.job)


def _side_names(direction: Direction) -> tuple[str, str]:
    return ("host", "device") if direction is Direction.LOADBACK else ("device", "host")


def _merge(acc: _Access, key: tuple[str, str, int], pages: npt.NDArray[np.int64]) -> None:
    old = acc.get(key)
    acc[key] = pages if old is None else np.union1d(old, pages)


class FakeAsyncBackend(CpuBackend):
    """CPU copies that complete only when the test says so (see the module docstring).

    Args:
        on_wait: what ``wait_layer`` does for a pending chunk: ``"raise"`` (default,
            :class:`NotReadyError`) or ``"complete"`` (complete that stream up to it).
    """

    name = "fake-async"

    def __init__(self, on_wait: str = "raise") -> None:
        if on_wait not in ("raise", "complete"):
            raise ConfigError(f"on_wait must be 'raise' or 'complete', got {on_wait!r}")
        self.on_wait = on_wait
        self._ids = itertools.count()
        self._last: dict[Direction, int] = {Direction.LOADBACK: -1, Direction.WRITEBACK: -1}
        self._queues: dict[Direction, deque[_Job]] = {Direction.LOADBACK: deque(), Direction.WRITEBACK: deque()}
        self._errors: dict[int, BaseException] = {}
        self._raise_on_issue: list[BaseException] = []
        self.completed: list[PendingCopy] = []

    # -- access sets and hazards ----------------------------------------------------------
    def _access(self, direction: Direction, plan: FlushPlan, chunk: ChunkPlan) -> tuple[_Access, _Access]:
        src_side, dst_side = _side_names(direction)
        reads: _Access = {}
        writes: _Access = {}
        for r in chunk.refs:
            g = plan.groups[r.group_index]
            _merge(reads, (src_side, r.group, r.layer), g.src)
            _merge(writes, (dst_side, r.group, r.layer), g.dst)
        return reads, writes

    @staticmethod
    def _clash(a: _Access, b: _Access) -> tuple[tuple[str, str, int], list[int]] | None:
        for key, pages in a.items():
            other = b.get(key)
            if other is not None:
                hit = np.intersect1d(pages, other)
                if hit.size:
                    return key, [int(x) for x in hit[:8]]
        return None

    def _check(self, stream: Direction, reads: _Access, writes: _Access,
               others: Iterable[tuple[Direction, str, _Access, _Access]], what: str) -> None:
        for other_stream, label, o_reads, o_writes in others:
            if other_stream is stream:
                continue
            for mine, theirs, verb in ((writes, o_writes, "writes pages also written by"),
                                       (writes, o_reads, "writes pages still read by"),
                                       (reads, o_writes, "reads pages still written by")):
                c = self._clash(mine, theirs)
                if c is not None:
                    (side, group, layer), pages = c
                    raise HazardError(
                        f"{what} on the {stream.value} stream {verb} {label}: "
                        f"{side} pages {pages} of cache group {group!r}, layer {layer} "
                        f"(the other stream is unordered with this one)")

    def _pending_access(self) -> list[tuple[Direction, str, _Access, _Access]]:
        out = []
        for stream, q in self._queues.items():
            for j in q:
                out.append((stream, f"pending copy {j.info.job} (ops {list(j.info.op_ids)}, "
                                    f"{stream.value} chunk {j.info.chunk})", j.reads, j.writes))
        return out

    def preflight(self, plans: list[FlushPlan]) -> None:
        pending = self._pending_access()
        new: list[tuple[Direction, str, _Access, _Access]] = []
        for plan in plans:
            for chunk in plan.chunks:
                reads, writes = self._access(plan.direction, plan, chunk)
                self._check(plan.direction, reads, writes, pending + new,
                            f"{plan.direction.value} chunk {chunk.index} of this flush")
                new.append((plan.direction, f"this flush's {plan.direction.value} chunk {chunk.index}",
                            reads, writes))

    # -- issuing --------------------------------------------------------------------------
    def raise_on_issue(self, error: BaseException | None = None) -> None:
        """Make the next :meth:`run_chunk` raise ``error`` (default :class:`InjectedFailure`)."""
        self._raise_on_issue.append(error or InjectedFailure("injected failure at issue"))

    def run_chunk(self, direction: Direction, plan: FlushPlan, chunk: ChunkPlan,
                  op_ids: tuple[int, ...]) -> ChunkCounts:
        if self._raise_on_issue:
            raise self._raise_on_issue.pop(0)
        src_pool, dst_pool = self.sides(direction)
        copies = []
        for r in chunk.refs:
            g = plan.groups[r.group_index]
            s_idx, d_idx = g.index_tensors()
            dst = dst_pool.region(r.group, r.component, r.layer)
            dst.index_fill_(0, d_idx, POISON_BYTE)
            copies.append((src_pool.region(r.group, r.component, r.layer), dst, s_idx, d_idx))
        reads, writes = self._access(direction, plan, chunk)
        job_id = next(self._ids)
        info = PendingCopy(job_id, direction, op_ids, chunk.index, chunk.layers)
        self._queues[direction].append(_Job(info, copies, writes, reads))
        self._last[direction] = job_id
        return ChunkCounts(copy_calls=len(copies))

    def begin(self, direction: Direction) -> TransferEvent:
        return FakeEvent(self, direction, self._last[direction])

    def record(self, direction: Direction) -> TransferEvent:
        return FakeEvent(self, direction, self._last[direction])

    def elapsed(self, start: TransferEvent, end: TransferEvent) -> float | None:
        return None

    # -- the test's controls ----------------------------------------------------------------
    def pending(self) -> list[PendingCopy]:
        """Pending copies of both streams, in issue order."""
        jobs = [j.info for q in self._queues.values() for j in q]
        return sorted(jobs, key=lambda p: p.job)

    def _run(self, job: _Job) -> None:
        error = job.fail
        if error is None:
            try:
                for src, dst, s_idx, d_idx in job.copies:
                    dst.index_copy_(0, d_idx, src.index_select(0, s_idx))
            except Exception as e:  # a copy that raises fails its job, never the caller
                error = e
        if error is not None:
            self._errors[job.info.job] = error
            job.error = error
        self.completed.append(job.info)

    def _head_stream(self, stream: Direction | None) -> Direction | None:
        if stream is not None:
            return stream if self._queues[stream] else None
        heads = [(q[0].info.job, s) for s, q in self._queues.items() if q]
        return min(heads)[1] if heads else None

    def complete_next(self, stream: Direction | None = None) -> PendingCopy | None:
        """Complete the oldest pending copy of ``stream`` (of either stream when None).

        Returns it, or None when there is nothing pending there."""
        s = self._head_stream(stream)
        if s is None:
            return None
        job = self._queues[s].popleft()
        self._run(job)
        return job.info

    def complete(self, op_id: int, chunk: int | None = None) -> list[PendingCopy]:
        """Complete the pending copy of ``op_id``'s chunk ``chunk`` (its last pending one
        when None), and first every copy issued before it on the same stream.

        Raises:
            ConfigError: no pending copy of that op (and chunk).
        """
        for s, q in self._queues.items():
            target = None
            for j in q:
                if op_id in j.info.op_ids and (chunk is None or j.info.chunk == chunk):
                    target = j.info.job
                    if chunk is not None:
                        break
            if target is not None:
                done = []
                while q and q[0].info.job <= target:
                    job = q.popleft()
                    self._run(job)
                    done.append(job.info)
                return done
        raise ConfigError(f"no pending copy for op {op_id}" + ("" if chunk is None else f" chunk {chunk}")
                          + f"; pending: {[(p.op_ids, p.chunk) for p in self.pending()]}")

    def complete_all(self) -> int:
        """Complete everything pending (streams interleaved in issue order); returns the count."""
        n = 0
        while self.complete_next() is not None:
            n += 1
        return n

    def fail_next(self, stream: Direction | None = None, error: BaseException | None = None) -> PendingCopy:
        """Make the oldest pending copy of ``stream`` (either stream when None) fail
        when it completes (its destinations stay poisoned).

        Raises:
            ConfigError: nothing pending there.
        """
        s = self._head_stream(stream)
        if s is None:
            raise ConfigError(f"fail_next: no pending copy on stream {stream}")
        job = self._queues[s][0]
        job.fail = error or InjectedFailure(f"injected failure of pending copy {job.info.job}")
        return job.info

    def synchronize(self) -> None:
        self.complete_all()

    def fence(self, event: TransferEvent) -> None:
        """The host waits for ``event``: every pending copy of its stream up to it
        completes now, as a real stream would reach it (``TransferEngine.cancel(wait=True)``)."""
        if not isinstance(event, FakeEvent):
            return
        q = self._queues[event.stream]
        while q and q[0].info.job <= event.job:
            self._run(q.popleft())

    def wait(self, event: TransferEvent) -> None:
        if not isinstance(event, FakeEvent) or event.done():
            return
        if self.on_wait == "complete":
            q = self._queues[event.stream]
            while q and q[0].info.job <= event.job:
                self._run(q.popleft())
            return
        ahead = [p for p in self.pending() if p.stream is event.stream and p.job <= event.job]
        raise NotReadyError(f"wait on the {event.stream.value} stream: {len(ahead)} pending copies "
                            f"(first: ops {list(ahead[0].op_ids)} chunk {ahead[0].chunk}) have not completed; "
                            f"complete them first (a real stream would block here)")

    # -- access checks for the test's compute side --------------------------------------------
    def _pending_on(self, side: str, group: str, layer: int, pages: Iterable[int],
                    kinds: tuple[str, ...]) -> tuple[PendingCopy, str, list[int]] | None:
        want = np.asarray(list(pages), dtype=np.int64)
        for q in self._queues.values():
            for j in q:
                for kind in kinds:
                    acc = j.writes if kind == "write" else j.reads
                    got = acc.get((side, group, layer))
                    if got is not None:
                        hit = np.intersect1d(want, got)
                        if hit.size:
                            return j.info, kind, [int(x) for x in hit[:8]]
        return None

    def check_read(self, side: str, group: str, layer: int, pages: Iterable[int]) -> None:
        """Raise :class:`PoisonedReadError` if a pending copy still writes any of the
        pages (``side`` is ``"host"`` or ``"device"``)."""
        hit = self._pending_on(side, group, layer, pages, ("write",))
        if hit is not None:
            info, _, p = hit
            raise PoisonedReadError(
                f"read of {side} pages {p} of cache group {group!r}, layer {layer}: pending copy "
                f"{info.job} (ops {list(info.op_ids)}, {info.stream.value} chunk {info.chunk}) still "
                f"writes them; they hold the poison byte {POISON_BYTE:#04x}")

    def check_write(self, side: str, group: str, layer: int, pages: Iterable[int]) -> None:
        """Raise :class:`HazardError` if a pending copy still reads or writes any of the pages."""
        hit = self._pending_on(side, group, layer, pages, ("read", "write"))
        if hit is not None:
            info, kind, p = hit
            raise HazardError(
                f"write to {side} pages {p} of cache group {group!r}, layer {layer}: pending copy "
                f"{info.job} (ops {list(info.op_ids)}, {info.stream.value} chunk {info.chunk}) still "
                f"{kind}s them")

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "on_wait": self.on_wait}
