"""The facade machine on the real transfer engine: :class:`EngineTransfer` routes every
command through one :class:`~kvtier.transfer.engine.TransferEngine` per rank, on the
fake-asynchronous backend (``transfer/backends/fake_async.py``), with failures injected at issue
time and at completion.

- Bytes are real. Every page the model writes (a forward pass's KV, a checkpoint) is
  written into every rank's pools as a pattern derived from its content value, through
  ``TransferEngine.write_pages`` (which refuses pages a pending copy still uses). When an
  operation settles successfully, every destination page of every rank must hold the
  pattern of what the model says its source held (invariant 12 on the engine's copies).
- Issue-time failures: before a command is flushed on a rank, a deterministic draw (from
  the setup's ``issue_seed``, the op id and the rank, at the example's fault rate)
  may make the flush raise at one of its chunks, after the earlier chunks were issued,
  before that chunk's copies are queued or after (a launch failing part-way): a
  half-issued operation, whose failure may be acknowledged only once those copies finish.
- Completion failures: delivering a completion with ``ok=False`` makes the next pending
  copy of that op on that rank fail (its destination stays poisoned).
- The engine's contract, checked on every operation no failure was injected into on a
  rank: a layer completion ``Completion(layer=L)`` comes only once every layer up to
  ``L`` of the destination pages holds its source's bytes (nothing pending writes them);
  after ``wait_layer(op, L)`` returns without :class:`NotReadyError`, layer ``L`` is
  readable and holds its bytes (what a forward pass overlapping the loadback reads); and
  an acknowledgement, a failed one included, comes only once no copy issued for the op
  is still pending on that rank (a half-issued operation's barrier).

Deadlines are on: an operation the core expires while its copy still runs is fenced
(spec ``[transfer]``, invariant ``copy_fence``), so its pages are reused by nothing until
the copy's late acknowledgement arrives, and the engine's hazard checks (a flush or a
write touching pages a pending copy uses) must never fire; every copy still completes
(late, after the deadline) and its acknowledgement must change nothing but release the fence.
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from collections.abc import Hashable
from typing import Any, ClassVar

import torch

from kvtier.fsm import Completion, Direction, UsageError
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.records import TransferCommand
from kvtier.transfer.engine import TransferEngine
from kvtier.transfer.errors import HazardError, PoisonedReadError
from kvtier.transfer.backends.fake_async import PendingCopy
from kvtier.transfer.backends.plan_exec import PlanExecBackend
from kvtier.transfer.plan import ChunkPlan, FlushPlan
from kvtier.transfer.pools import DevicePool, HostPool

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvtier.fsm.node import HOST_VISIBLE

from ..tiered import TieredCache
from .budget_model import check_split_of_pool
from . import _views as views
from .base import recorded
from .engine_contract import EngineContract, pattern as _pattern
from .engine_stats import EngineStatsModel
from .facade_machine import FacadeMachine
from .models import ModelViolation
from .plugs import TransferBackend

__all__ = ["EngineTransfer", "EngineFacadeMachine", "FaultyBackend"]

_LOG = logging.getLogger("kvtier.transfer")


class FaultyBackend(PlanExecBackend):
    """The plan-executing fake-asynchronous backend (``transfer/backends/plan_exec.py``:
    the planner's run or row tables executed on the CPU pools, or index copies) with two
    test controls: :meth:`fail_at` makes the
    ``k``-th chunk issued from now raise (earlier chunks stay issued), before anything
    of it is queued or, with ``after``, once its copies are queued (a launch that fails
    part-way: those copies still run), and :meth:`fail_job` makes one pending copy fail
    when it completes."""

    def __init__(self, mode: str = "index", piece_bytes: int = 16, seed: int = 0) -> None:
        super().__init__(mode=mode, piece_bytes=piece_bytes, seed=seed, on_wait="raise")
        self._fail_in: int | None = None
        self._fail_after = False

    def fail_at(self, k: int, after: bool = False) -> None:
        self._fail_in = k
        self._fail_after = after

    def run_chunk(self, direction: Direction, plan: FlushPlan, chunk: ChunkPlan,
                  op_ids: tuple[int, ...]) -> Any:
        if self._fail_in is not None:
            if self._fail_in == 0:
                self._fail_in = None
                if self._fail_after:
                    super().run_chunk(direction, plan, chunk, op_ids)  # queued, then the launch fails
                    raise RuntimeError("injected failure part-way through issuing a chunk")
                self.raise_on_issue()
            else:
                self._fail_in -= 1
        return super().run_chunk(direction, plan, chunk, op_ids)

    def clear_fault(self) -> None:
        self._fail_in = None

    def fail_job(self, job: int) -> None:
        """Make pending copy ``job`` fail when it completes."""
        for q in self._queues.values():
            for j in q:
                if j.info.job == job:
                    j.fail = RuntimeError(f"injected failure of pending copy {job}")
                    return


class _Store(dict[tuple[str, int], Any]):
    """A tier's content model; a write also writes the pattern into the real pools."""

    def __init__(self, owner: EngineTransfer, side: str) -> None:
        super().__init__()
        self.owner = owner
        self.side = side

    def __setitem__(self, key: tuple[str, int], value: Any) -> None:
        self.owner.write(self.side, key[0], key[1], value)
        super().__setitem__(key, value)


class EngineTransfer(EngineContract, TransferBackend):
    """A :class:`TransferBackend` backed by real transfer engines (one per rank) on the
    fake-asynchronous backend; see the module docstring.

    Args:
        world_size: ranks.
        layout: the cache layout (the engines' cache groups).
        device_pages: device pool pages per group (the core's capacity).
        host_pages: host pool pages per group (the core's capacity).
        issue_seed: seed of the issue-time failure draws.
        issue_rate: chance that a rank's flush of a command fails at issue.
        chunk_layers: layers per loadback chunk (small: several chunks per loadback).
        plan_mode: the copy path of every rank's backend (``transfer/backends/plan_exec.py``: the planner's
            run tables, its row tables, or index copies).
        piece_bytes: the tables' largest piece (small: runs and rows split into many pieces).
    """

    def __init__(self, world_size: int, layout: CacheLayout, device_pages: dict[str, int],
                 host_pages: dict[str, int], *, issue_seed: int = 0, issue_rate: float = 0.0,
                 chunk_layers: int = 1, plan_mode: str = "index", piece_bytes: int = 16,
                 hold_rate: float = 0.0) -> None:
        super().__init__(world_size, layout.num_layers)
        specs = list(layout.groups)
        self.specs = {g.name: g for g in specs}
        check_split_of_pool(specs, host_pages, issue_seed)  # the host pool's size as a budget (budget_model)
        self.issue_seed = issue_seed
        self.issue_rate = issue_rate
        self.plan_mode = plan_mode
        self.backends = [FaultyBackend(plan_mode, piece_bytes, issue_seed + r) for r in range(world_size)]
        self.engines = [TransferEngine(specs, HostPool(specs, {g: max(1, n) for g, n in host_pages.items()}, pin=False),
                                       DevicePool.allocate(specs, {g: max(1, n) for g, n in device_pages.items()}, "cpu"),
                                       self.backends[r], rank=r, chunk_layers=chunk_layers)
                        for r in range(world_size)]
        self.buffered: dict[tuple[int, int], deque[Completion]] = {}
        self.dev = _Store(self, "device")
        self.host = _Store(self, "host")
        self.issue_failures = 0
        self.injected: set[tuple[int, int]] = set()  # (op, rank) a failure was injected into
        self.late: set[int] = set()  # ops the core expired whose copies may still be pending: delivered late
        self.hold_rate = hold_rate
        self.device_pages = {g: max(1, n) for g, n in device_pages.items()}
        self.host_pages = {g: max(1, n) for g, n in host_pages.items()}
        self.held: list[int] = []  # ops submitted to every engine and not flushed yet (queued)
        self.hold_next = False  # hold every command submitted while set
        self.probes = 0
        self.stats_models = [EngineStatsModel(layout, chunk_layers, r) for r in range(world_size)]

    # -- real bytes ------------------------------------------------------------------
    def write(self, side: str, group: str, page: int, value: Any) -> None:
        """Write the pattern of ``value`` into ``page`` of ``group`` on every rank."""
        spec = self.specs[group]
        for eng in self.engines:
            for comp in spec.components:
                data = _pattern(value, comp.page_bytes).view(1, -1)
                for layer in spec.layers:
                    try:
                        eng.write_pages(side, group, comp.name, layer, [page], data)
                    except HazardError as exc:
                        raise ModelViolation("model_transfer_hazard", f"{side} page {page} of {group!r}",
                                             f"written while a pending copy uses it: {exc}") from None

    def _check_bytes(self, side: str, group: str, page: int, value: Any, op: int) -> None:
        spec = self.specs[group]
        for eng in self.engines:
            for comp in spec.components:
                want = _pattern(value, comp.page_bytes)
                for layer in spec.layers:
                    try:
                        got = eng.read_pages(side, group, comp.name, layer, [page])[0]
                    except PoisonedReadError as exc:
                        raise ModelViolation("model_transfer_hazard", f"op {op}",
                                             f"settled while a copy still writes its destination: {exc}") from None
                    if not torch.equal(got, want):
                        raise ModelViolation("loaded_equals_written", f"op {op} on rank {eng.rank}",
                                             f"{side} page {page} of {group!r} (layer {layer}, {comp.name}) does "
                                             f"not hold what its source held ({value!r})")

    # -- the plug interface ------------------------------------------------------------
    def _draw(self, op: int, rank: int) -> int:
        digest = hashlib.sha256(f"{self.issue_seed}:{op}:{rank}".encode()).digest()
        return int.from_bytes(digest[:4], "big")

    def _submit_all(self, cmd: TransferCommand) -> None:
        for rank, eng in enumerate(self.engines):
            try:
                eng.submit(cmd)
            except UsageError as exc:  # the core never has clashing commands in flight at once
                raise ModelViolation("model_transfer_hazard", f"op {cmd.op_id} on rank {rank}",
                                     f"refused while ops {eng.queued} are queued: {exc}") from None

    def submit(self, cmd: TransferCommand) -> None:
        """Submit ``cmd`` to every rank's engine, then flush, unless a draw (``hold_rate``)
        holds it queued until the next flush (a later submit, or a completion asked for)."""
        if cmd.op_id in self.commands:
            return
        self.commands[cmd.op_id] = cmd
        self._submit_all(cmd)
        if self.hold_next or (self._draw(cmd.op_id, -1) >> 8) % 1000 < int(round(self.hold_rate * 1000)):
            self.held.append(cmd.op_id)
            return
        flushed, self.held = [*self.held, cmd.op_id], []
        for rank, eng in enumerate(self.engines):
            draw = self._draw(cmd.op_id, rank)
            if draw % 1000 < int(round(self.issue_rate * 1000)):
                # at its 1st, 2nd or 3rd chunk, before or after that chunk's copies are queued
                self.backends[rank].fail_at((draw >> 10) % 3, after=bool((draw >> 12) & 1))
                self.issue_failures += 1
                self.injected.update((op, rank) for op in flushed)  # (held ops share the flight)
            self._flush(rank, eng)

    def flush_held(self) -> None:
        """Flush what is held queued, on every rank, with no failure injected."""
        if self.held:
            self.held = []
            for rank, eng in enumerate(self.engines):
                self._flush(rank, eng)

    def _flush(self, rank: int, eng: TransferEngine) -> None:
        quiet = _LOG.level
        _LOG.setLevel(logging.CRITICAL)  # injected issue failures are logged as exceptions
        queued = eng.queued
        cmds = [self.commands[op] for op in queued]
        faulty = self.backends[rank]._fail_in is not None
        try:
            eng.flush()
        except HazardError as exc:
            raise ModelViolation("model_transfer_hazard", f"ops {list(queued)} on rank {rank}",
                                 f"issued while a pending copy uses its pages: {exc}") from None
        finally:
            _LOG.setLevel(quiet)
            self.backends[rank].clear_fault()
        self.stats_models[rank].flushed(cmds, faulty)  # (model_engine_stats)
        self.stats_models[rank].check(eng.stats())
        self._collect(rank)

    def _collect(self, rank: int) -> None:
        for c in self.engines[rank].poll_completions():
            self.buffered.setdefault((c.op_id, rank), deque()).append(c)

    def _pending(self, rank: int) -> list[PendingCopy]:
        return self.backends[rank].pending()

    def ready(self) -> list[tuple[int, int]]:
        pairs = {k for k, q in self.buffered.items() if q}
        pairs.update((op, rank) for op in self.held for rank in range(self.world_size))
        for rank in range(self.world_size):
            for p in self._pending(rank):
                pairs.update((op, rank) for op in p.op_ids if op in self.commands or op in self.late)
        return sorted(pairs)

    def take(self, op: int, rank: int, ok: bool) -> Completion:
        """The next completion of ``op`` on ``rank``: a buffered one, else its next pending
        copy (and those before it on its stream) completes, failing when not ``ok``."""
        if op in self.held:  # the engine waits for what it holds: flush first
            self.flush_held()
        backend = self.backends[rank]
        first = True
        while not self.buffered.get((op, rank)):
            mine = [p for p in self._pending(rank) if op in p.op_ids]
            if not mine:
                raise ModelViolation("model_liveness", f"op {op} on rank {rank}",
                                     "nothing pending or buffered: the engine lost its completion")
            if first and not ok:
                backend.fail_job(mine[0].job)
                self.injected.add((op, rank))
            first = False
            backend.complete(op, mine[0].chunk)
            self._collect(rank)
        q = self.buffered[(op, rank)]
        c = q.popleft()
        if not q:
            del self.buffered[(op, rank)]
        if c.layer is None and any(op in p.op_ids for p in self._pending(rank)):
            raise ModelViolation("model_transfer_hazard", f"op {op} on rank {rank}",
                                 f"acknowledged ({'ok' if c.ok else 'failed'}) while a copy issued for it is "
                                 f"still pending: its pages may be reused under that copy")
        if c.ok and c.layer is not None:  # (a failed or never issued chunk is never reported)
            self.check_layers(op, rank, range(c.layer + 1), "reported loaded")
        return c

    def apply(self, op: int, ok: bool) -> None:
        cmd = self.commands.pop(op, None)
        if cmd is None:
            return
        if not ok:  # expired with copies still pending: they complete late (their ack releases its fence)
            self.late.add(op)
            self.cancel(cmd)
        src, dst = (self.dev, self.host) if cmd.direction is Direction.WRITEBACK else (self.host, self.dev)
        dst_side = "host" if cmd.direction is Direction.WRITEBACK else "device"
        for t in cmd.transfers:
            for s, d in zip(t.src_pages, t.dst_pages):
                value = src.get((t.group, s)) if ok else ("garbage", op)
                if ok and value is not None:
                    self._check_bytes(dst_side, t.group, d, value, op)
                dict.__setitem__(dst, (t.group, d), value)


class EngineFacadeMachine(FacadeMachine):
    """The facade machine with :class:`EngineTransfer`: the real transfer engine on the
    fake-asynchronous backend, failures at issue and at completion (registered as
    ``engine``)."""

    kit_deadlines: ClassVar[bool] = True  # an expired copy completes late: its pages stay fenced till then
    kit_host_optional: ClassVar[bool] = False  # the engine's pools need a host tier
    kit_invariants: ClassVar[tuple[str, ...]] = (*FacadeMachine.kit_invariants, "check_engine_waits")

    def check_engine_waits(self) -> None:
        """Model: ``wait_layer`` and the loaded bytes (:meth:`EngineTransfer.check_waits`)."""
        if hasattr(self, "xfer") and isinstance(self.xfer, EngineTransfer):
            self.xfer.check_waits()

    @precondition(lambda self: hasattr(self, "cache")
                  and any(n.state in HOST_VISIBLE for n in views.nodes(self.cache.core).values()))
    @rule(req=st.integers(0, 2), i=st.integers(0, 100), chunk=st.integers(1, 3))
    @recorded
    def reload(self, req: int, i: int, chunk: int) -> None:
        """``admit_cached`` after a demotion: a loadback in chunks through the engines
        (the transfers this machine exists for; the facade rules alone make few)."""
        FacadeMachine.admit_cached.__wrapped__(self, req=req, i=i, chunk=chunk, tail=True, demote=True)  # type: ignore[attr-defined]

    @precondition(lambda self: self.deadline is not None)
    @rule(req=st.integers(0, 2), i=st.integers(0, 100))
    @recorded
    def expire_queued(self, req: int, i: int) -> None:
        """A loadback (else a new prompt's writebacks) handed out and held queued by the
        engines (not flushed) when its deadline passes: the engines cancel it
        (``"cancelled"``; its pages are free for the other direction at once), and its late
        failed acknowledgement releases its fence."""
        rid = self._rid(req)
        r = views.requests(self.cache).get(rid)
        if r is not None and (r.state not in ("waiting", "finished", "aborted") or not r.settled):
            return
        assert isinstance(self.xfer, EngineTransfer) and self.deadline is not None
        if self._admit_host_hit(rid, i) is None:  # no loadback: the writebacks of a new prompt's pass
            if self._state(rid) not in (None, "waiting", "finished", "aborted"):
                return
            self.fresh = getattr(self, "fresh", 0) + 1
            self.units[rid] = [f"{rid}.q{self.fresh}"]
            align = self.cache.layout.alignment
            self._admit(rid, align + 1, 2 * align)
            if self._state(rid) == "running":
                self._forward(rid, False, False)
        self.xfer.hold_next = True
        try:
            self._poll()
        finally:
            self.xfer.hold_next = False
        before = set(views.ops(self.cache.core))
        self.sched.advance_step(self.deadline + 1)
        self.expired |= before - set(views.ops(self.cache.core))
        self._sync()

    def xfer_faults_off(self) -> None:
        """The drain issues every copy without an injected failure."""
        if isinstance(self.xfer, EngineTransfer):
            self.xfer.issue_rate = 0.0

    def make_transfer(self, world: int, num_layers: int) -> TransferBackend:
        core = self.cache.core
        dev = {g: a.capacity for g, a in core.device.items()}
        host = {g: a.capacity for g, a in (core.host or {}).items()}
        digest = hashlib.sha256(repr(self.kit_trace[0].args if self.kit_trace else ()).encode()).digest()
        draw = int.from_bytes(digest[:4], "big")
        # the copy path and the tables' piece size follow from the setup too (a saved
        # sequence replays on the same path): mostly the planner's tables, small pieces
        mode = ("runs", "rows", "runs", "index")[digest[4] % 4]
        # loadback chunks of one to three layers (a chunk's first and last layer differ: what
        # wait_layer must tell apart), and a share of commands held queued (cancelled there)
        xfer = EngineTransfer(world, self.cache.layout, dev, host, issue_seed=draw, issue_rate=self.kit_rate,
                              plan_mode=mode, piece_bytes=(16, 32, 64, 128)[digest[5] % 4],
                              chunk_layers=(1, 2, 3)[digest[6] % 3], hold_rate=(0.0, 0.25, 0.5)[digest[7] % 3])
        self.counters.engine = (xfer.engines[0], xfer.stats_models[0])  # the exporter reads rank 0's engine
        return xfer

    def kit_canonical(self) -> Hashable:  # pragma: no cover - verify runs the dict backend
        raise NotImplementedError("kvtier verify runs the facade machine on the simulated backend")


_ = TieredCache
