"""The transfer engine: queue commands, flush them, poll completions.

One engine per rank (world size 1 per engine). All methods run on the caller's (the
scheduler's) thread; completions are collected by polling events, never by callbacks
from another thread.

Typical use::

    engine = TransferEngine(specs, HostPool(specs, 4096), DevicePool.allocate(specs, 1024))
    engine.submit(command)            # queue (validated now)
    engine.flush()                    # issue: loadbacks first, in layer chunks
    ...
    engine.wait_layer(op_id, layer)   # before the forward pass reads that layer
    for c in engine.poll_completions():
        cache.complete(c)             # the facade's (or the core's) complete

An operation whose deadline passed (``op_deadline_steps``) stays *fenced* in the cache
until this engine acknowledges it (spec ``[transfer]``): issued copies cannot be
stopped, so its pages are reused only once its acknowledgement came. ``cancel`` makes
that acknowledgement come soon::

    for op_id in cache.core.fenced_ops():
        engine.cancel(op_id)          # queued: taken back; issued: its ack comes at its end
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.fsm import (
    CacheGroupSpec,
    Completion,
    ConfigError,
    Direction,
    TransferCommand,
    UnknownOperation,
)

from .access import PageAccess
from .arrays import ArrayCommand
from .backends import Backend, TransferEvent, make_backend
from .errors import TransferError
from .layers import LayerCounter, OpLayers
from .plan import ChunkPlan, FlushPlan, Planner, layers_for
from .pools import DevicePool, HostPool, _Pool
from .stats import DirectionStats, TransferStats

__all__ = ["TransferEngine"]

log = logging.getLogger("kvtier.transfer")


@dataclass(eq=False)
class _Flight:
    direction: Direction
    plan: FlushPlan
    counter: LayerCounter
    ops: list[OpLayers] = field(default_factory=list)
    start: TransferEvent | None = None
    issued_at: float = 0.0
    stats: DirectionStats = field(default_factory=DirectionStats)


class TransferEngine(PageAccess):
    """Executes :class:`TransferCommand` records between a host and a device pool.

    Args:
        specs: the cache groups; must equal the pools' specs.
        host: host (L2) pool; source of loadbacks, destination of writebacks.
        device: device (L1) pool.
        backend: ``"auto"`` (default: ``"hybrid"`` on a real GPU with numba-cuda, else
            ``"torch"`` with CUDA, ``"cpu"`` without; never ``"hybrid"`` or ``"numba"``
            under the CUDA simulator), a backend name (``"hybrid"``, ``"numba"``,
            ``"torch"``, ``"cpu"``, ``"fake-async"``) or a :class:`Backend` instance.
        backend_options: keyword arguments for the named backend's constructor (e.g.
            ``{"blocks": 8, "threads": 1024}`` for ``"numba"`` and ``"hybrid"``).
        rank: this engine's tensor-parallel rank, put into every completion.
        chunk_layers: model layers per loadback chunk (default 4).
        plan_cache_size: whole plans kept for re-use (LRU, default 16; 0 disables).
        log_interval_s: at most one DEBUG statistics line per this many seconds.

    Raises:
        ConfigError: specs that differ from the pools', bad options.
        BackendUnavailable: the backend cannot run with these pools on this machine.
    """

    def __init__(self, specs: Sequence[CacheGroupSpec], host: HostPool, device: DevicePool,
                 backend: str | Backend = "auto", *, backend_options: Mapping[str, Any] | None = None,
                 rank: int = 0, chunk_layers: int = 4, plan_cache_size: int = 16,
                 log_interval_s: float = 10.0) -> None:
        if isinstance(specs, CacheGroupSpec):
            specs = [specs]
        by_name = {s.name: s for s in specs}
        if not isinstance(host, HostPool):
            raise ConfigError(f"host must be a HostPool, got {type(host).__name__}")
        if not isinstance(device, DevicePool):
            raise ConfigError(f"device must be a DevicePool, got {type(device).__name__}")
        for label, pool in (("host", host), ("device", device)):
            if pool.specs != by_name:
                raise ConfigError(f"the {label} pool was built for cache groups {sorted(pool.specs)}, "
                                  f"which differ from the engine's specs {sorted(by_name)}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ConfigError(f"rank must be an int >= 0, got {rank!r}")
        self.specs = by_name
        self.host = host
        self.device = device
        self.rank = rank
        self.planner = Planner(list(by_name.values()), host, device, chunk_layers=chunk_layers,
                               plan_cache_size=plan_cache_size)
        if isinstance(backend, Backend):
            if backend_options:
                raise ConfigError("backend_options are only for a backend given by name")
            self.backend = backend
        elif isinstance(backend, str):
            self.backend = make_backend(backend, device.device.type == "cuda", **dict(backend_options or {}))
        else:
            raise ConfigError(f"backend must be a name or a Backend, got {backend!r}")
        self.backend.bind(host, device, self.planner)
        self._queue: dict[Direction, list[TransferCommand | ArrayCommand]] = {d: [] for d in Direction}
        self._op_layers: dict[int, set[int]] = {}
        self._flights: list[_Flight] = []
        self._inflight: dict[int, tuple[_Flight, OpLayers]] = {}
        self._ready: list[Completion] = []
        self._finished: OrderedDict[int, None] = OrderedDict()
        self._stats = TransferStats(log_interval_s)

    # -- submit ---------------------------------------------------------------------------
    def submit(self, command: TransferCommand | ArrayCommand) -> None:
        """Queue a command for the next :meth:`flush`. Validates it now (vectorised:
        one min/max per page array).

        Takes the core's :class:`~kvtier.fsm.TransferCommand` (page ids as tuples,
        converted to int64 arrays here, cached by the identity of its transfer records)
        or an :class:`~kvtier.transfer.ArrayCommand` (page ids already int64 arrays:
        no per-page Python work from here to the copies).

        Raises:
            ConfigError: not a TransferCommand or ArrayCommand; op id already queued or
                in flight; an unknown cache group; a page id outside its pool; pages of
                a group none of whose layers the command moves. Nothing is queued then.
            UsageError: a loadback and a writeback of the same page in one flush (a
                device page one writes and the other reads, or a host page likewise):
                the two streams are unordered (:meth:`Planner.check_same_pages`). Nothing
                is queued then.
        """
        if not isinstance(command, (TransferCommand, ArrayCommand)):
            raise ConfigError(f"submit() takes a TransferCommand or ArrayCommand, got {type(command).__name__}")
        op = command.op_id
        if isinstance(op, bool) or not isinstance(op, int):
            raise ConfigError(f"op_id must be an int, got {op!r}")
        if op in self._op_layers:
            raise ConfigError(f"op {op} is already queued or in flight on rank {self.rank}")
        src_pool, dst_pool = self._sides(command.direction)
        src_label, dst_label = ("host", "device") if command.direction is Direction.LOADBACK else ("device", "host")
        op_layers: set[int] = set()
        for t in command.transfers:
            spec = self.specs.get(t.group)
            if spec is None:
                raise ConfigError(f"op {op}: unknown cache group {t.group!r}; known: {sorted(self.specs)}")
            if len(t.src_pages) == 0:
                continue
            layers = layers_for(command, spec)
            if not layers:
                raise ConfigError(f"op {op}: moves pages of cache group {t.group!r} but none of its layers "
                                  f"{list(spec.layers)} is in the command's layers {list(command.layers)}")
            s, d = self.planner.arrays(t)
            for label, pool, arr in ((src_label, src_pool, s), (dst_label, dst_pool, d)):
                n = pool.pages(t.group)
                hi = int(arr.max())
                if hi >= n:
                    raise ConfigError(f"op {op}: {label} page {hi} of cache group {t.group!r} is out of range: "
                                      f"the {label} pool has {n} pages (ids 0..{n - 1})")
            op_layers.update(layers)
        other = Direction.WRITEBACK if command.direction is Direction.LOADBACK else Direction.LOADBACK
        if self._queue[other]:
            self.planner.check_same_pages(command, self._queue[other])
        self.planner.queue(command)
        self._queue[command.direction].append(command)
        self._op_layers[op] = op_layers

    def _sides(self, direction: Direction) -> tuple[_Pool, _Pool]:
        if direction is Direction.LOADBACK:
            return self.host, self.device
        return self.device, self.host

    # -- flush ----------------------------------------------------------------------------
    def flush(self) -> None:
        """Issue every queued command: loadbacks first (merged, in layer chunks, on the
        loadback stream), then writebacks (merged, one chunk, on the writeback stream),
        each stream ordered after the current (compute) stream; with a backend whose
        ``interleave_directions`` is True (the hybrid backend with its staging path),
        both directions' host work first, then one chunk of each direction in turn.
        Returns without waiting.

        A copy that raises fails its operations (``Completion(ok=False)`` from
        :meth:`poll_completions`), never the caller.

        Raises:
            HazardError: fake-async backend only: the flush would touch pages that a
                pending copy on the other stream uses; nothing was issued and the
                commands stay queued.
        """
        work = [(d, self._queue[d]) for d in (Direction.LOADBACK, Direction.WRITEBACK) if self._queue[d]]
        if not work:
            return
        plans: list[tuple[Direction, list[TransferCommand | ArrayCommand], FlushPlan | BaseException]] = []
        for direction, cmds in work:
            try:
                plans.append((direction, cmds, self.planner.plan(direction, cmds)))
            except Exception as e:  # a planning bug must not crash the scheduler
                log.exception("transfer: planning %d %s ops failed", len(cmds), direction.value)
                plans.append((direction, cmds, e))
        self.backend.preflight([p for _, _, p in plans if isinstance(p, FlushPlan)])  # may raise HazardError
        for direction, _ in work:
            self._queue[direction] = []
            self.planner.unqueue(direction)
        self._stats.begin_flush()
        flights: list[tuple[_Flight, tuple[int, ...]]] = []
        for direction, cmds, plan in plans:
            if isinstance(plan, FlushPlan):
                opened = self._open(direction, cmds, plan)
                if opened is not None:
                    flights.append(opened)
            else:
                for c in cmds:
                    self._fail_now(c.op_id)
        if self.backend.interleave_directions and len(flights) > 1:
            # every direction's host work first (its tables go out before any bulk copy),
            # then one chunk of each in turn
            ready = [(f, ops) for f, ops in flights if self._prepare(f, ops)]
            turns = [(f, ops, iter(f.plan.chunks)) for f, ops in ready if self._begin(f, ops)]
            while turns:
                keep = []
                for f, ops, chunks in turns:
                    chunk = next(chunks, None)
                    if chunk is not None and self._issue_chunk(f, chunk, ops):
                        keep.append((f, ops, chunks))
                turns = keep
        else:
            for f, ops in flights:
                if self._prepare(f, ops) and self._begin(f, ops):
                    for chunk in f.plan.chunks:
                        if not self._issue_chunk(f, chunk, ops):
                            break
        for f, _ in flights:
            self._stats.issued(f.direction, f.stats)

    def _fail_now(self, op_id: int) -> None:
        self._ready.append(Completion(op_id, self.rank, False))
        self._op_layers.pop(op_id, None)
        self._remember(op_id)

    def _open(self, direction: Direction, cmds: list[TransferCommand | ArrayCommand],
              plan: FlushPlan) -> tuple[_Flight, tuple[int, ...]] | None:
        """Fail the plan's rejected commands; register a flight for the rest (None when
        none is left)."""
        for i, reason in plan.rejected.items():
            log.warning("transfer: op %d rejected: %s", cmds[i].op_id, reason)
            self._fail_now(cmds[i].op_id)
        ok_cmds = [c for i, c in enumerate(cmds) if i not in plan.rejected]
        if not ok_cmds:
            return None
        flight = _Flight(direction, plan, LayerCounter(len(plan.chunks)), issued_at=time.perf_counter())
        chunk_layers = [c.layers for c in plan.chunks]
        for c in ok_cmds:
            if direction is Direction.LOADBACK:
                ol = OpLayers.build(c.op_id, self._op_layers[c.op_id], chunk_layers)
            else:
                ol = OpLayers(c.op_id, [])
            flight.ops.append(ol)
            self._inflight[c.op_id] = (flight, ol)
        flight.stats = DirectionStats(flushes=1, ops=len(ok_cmds), pages=plan.pages, spans=plan.spans)
        self._flights.append(flight)
        return flight, tuple(c.op_id for c in ok_cmds)

    def _prepare(self, flight: _Flight, op_ids: tuple[int, ...]) -> bool:
        """The backend's host work for the flight (before its start event); False when
        there is nothing to issue or it failed (the ops then fail)."""
        if not flight.plan.chunks:
            return False
        try:
            self.backend.prepare(flight.direction, flight.plan)  # host work first: not inside the timed region
        except Exception as e:
            log.exception("transfer: preparing %s for the %s stream failed", op_ids, flight.direction.value)
            flight.counter.error = e
            return False
        return True

    def _begin(self, flight: _Flight, op_ids: tuple[int, ...]) -> bool:
        """The flight's start event; False when it failed (the ops then fail)."""
        try:
            flight.start = self.backend.begin(flight.direction)
        except Exception as e:
            log.exception("transfer: starting %s on the %s stream failed", op_ids, flight.direction.value)
            flight.counter.error = e
            return False
        return True

    def _issue_chunk(self, flight: _Flight, chunk: ChunkPlan, op_ids: tuple[int, ...]) -> bool:
        """Issue one chunk and record its event; False after a failure (the flight's
        later chunks are not issued, its ops fail)."""
        direction, plan, counter, ds = flight.direction, flight.plan, flight.counter, flight.stats
        try:
            counts = self.backend.run_chunk(direction, plan, chunk, op_ids)
            ev = self.backend.record(direction)
        except Exception as e:
            log.exception("transfer: %s chunk %d of ops %s failed", direction.value, chunk.index, op_ids)
            counter.error = e
            try:  # the ack waits for whatever was issued before the failure
                counter.events.append(self.backend.record(direction))
            except Exception:
                pass
            return False
        counter.events.append(ev)
        counter.issued_chunks += 1
        ds.chunks += 1
        ds.tensor_refs += chunk.tensor_refs
        ds.rows += chunk.rows
        ds.copy_calls += counts.copy_calls
        ds.kernel_launches += counts.kernel_launches
        ds.bytes += chunk.nbytes
        ds.sm_bytes += counts.sm_bytes
        ds.sm_copies += counts.sm_copies
        ds.ce_bytes += counts.ce_bytes
        ds.ce_copies += counts.ce_copies
        ds.ce_calls += counts.ce_calls
        ds.waits += counts.waits
        ds.stage_bytes += counts.stage_bytes
        ds.stage_copies += counts.stage_copies
        ds.ring_waits += counts.ring_waits
        ds.max_blocks = max(ds.max_blocks, counts.thread_blocks)
        return True

    # -- completions ------------------------------------------------------------------------
    def poll_completions(self) -> list[Completion]:
        """Collect what has finished, without blocking.

        For each loadback op: one ``Completion(layer=L)`` per completed chunk holding
        any of its layers (``L`` = its last layer in that chunk), in order; then, after
        the last chunk, exactly one acknowledgement (``layer=None``). Writebacks get the
        acknowledgement only. A failed copy gives ``ok=False`` acknowledgements, sent
        only once nothing issued for the op is still running.
        """
        out = self._ready
        self._ready = []
        keep: list[_Flight] = []
        for flight in self._flights:
            c = flight.counter
            c.poll()
            ok = c.ok_chunks
            for op in flight.ops:
                while op.reported < len(op.chunks) and op.chunks[op.reported][0] < ok:
                    out.append(Completion(op.op_id, self.rank, True, op.chunks[op.reported][2]))
                    op.reported += 1
            if not c.finished:
                keep.append(flight)
                continue
            success = c.error is None
            for op in flight.ops:
                out.append(Completion(op.op_id, self.rank, success))
                op.acked = True
                self._inflight.pop(op.op_id, None)
                self._op_layers.pop(op.op_id, None)
                self._remember(op.op_id)
            self._account(flight, success)
        self._flights = keep
        self._stats.maybe_log()
        return out

    def _account(self, flight: _Flight, success: bool) -> None:
        secs: float | None = None
        events = flight.counter.events
        if success and flight.start is not None and events:
            try:
                secs = self.backend.elapsed(flight.start, events[-1])
            except Exception:
                secs = None
        failed = 0 if success else len(flight.ops)
        self._stats.timed(flight.direction, flight.stats, flight.stats.bytes if secs is not None else 0,
                          secs or 0.0, failed)

    def _remember(self, op_id: int) -> None:
        self._finished[op_id] = None
        if len(self._finished) > 4096:
            self._finished.popitem(last=False)

    # -- layer waits --------------------------------------------------------------------------
    def wait_layer(self, op_id: int, layer: int) -> None:
        """Make the current stream wait until ``layer`` of loadback ``op_id`` is loaded
        (the chunk holding the op's last layer <= ``layer``). No-op when the op is
        already acknowledged or moves no layer <= ``layer``.

        Fake-async backend: raises :class:`NotReadyError` if that chunk is pending
        (or completes it, with ``on_wait="complete"``).

        Raises:
            ConfigError: ``op_id`` is a writeback.
            TransferError: ``op_id`` is queued but not flushed yet.
            UnknownOperation: ``op_id`` is neither queued, in flight, nor among the last
                4096 finished operations.
        """
        entry = self._inflight.get(op_id)
        if entry is None:
            if op_id in self._finished:
                return
            if op_id in self._op_layers:
                raise TransferError(f"wait_layer: op {op_id} is queued but not flushed; call flush() first")
            raise UnknownOperation(f"wait_layer: op {op_id} is not queued, in flight, or recently finished "
                                   f"on rank {self.rank}")
        flight, ol = entry
        if flight.direction is not Direction.LOADBACK:
            raise ConfigError(f"wait_layer: op {op_id} is a {flight.direction.value}; only loadbacks have layers")
        ci = ol.chunk_for(layer)
        c = flight.counter
        if ci is None or ci >= c.issued_chunks:
            return  # nothing to wait for, or never issued (the op will fail)
        self.backend.wait(c.events[ci])

    # -- cancel ---------------------------------------------------------------------------
    def cancel(self, op_id: int, *, wait: bool = False) -> str:
        """Stop operation ``op_id`` from touching pages where possible, and make its
        acknowledgement come: the confirmation the cache needs to release the pages of
        an operation its deadline failed (spec ``[transfer]``, event ``copy_ended``).

        Args:
            op_id: the operation.
            wait: for an issued operation, block the host until its copies ended
                (:meth:`Backend.fence` on its flight's last event; the fake-async
                backend completes its stream up to there).

        Returns:
            ``"cancelled"``: it was queued, not flushed: taken out of the queue, no byte
            moved; its failed acknowledgement comes from the next :meth:`poll_completions`.
            ``"fenced"``: it was issued; copies on a stream cannot be stopped, so its
            acknowledgement comes from the first :meth:`poll_completions` after they
            ended (the next one with ``wait=True``). ``"ended"``: already acknowledged
            (or waiting in the next poll). ``"unknown"``: never seen, or forgotten (more
            than 4096 operations ago). Nothing is raised: a cancel is always safe.
        """
        for direction in Direction:
            queue = self._queue[direction]
            for i, c in enumerate(queue):
                if c.op_id == op_id:
                    del queue[i]
                    self.planner.unqueue(direction, queue)
                    self._fail_now(op_id)
                    return "cancelled"
        entry = self._inflight.get(op_id)
        if entry is not None:
            events = entry[0].counter.events
            if wait and events:
                self.backend.fence(events[-1])
            return "fenced"
        return "ended" if op_id in self._finished else "unknown"

    # -- misc -------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Block until every issued copy finished (fake-async: complete them all)."""
        self.backend.synchronize()

    def clear_plan_cache(self) -> None:
        """Forget cached plans and address tables (benchmarks time plan building this way)."""
        self.planner.clear()

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Op ids issued and not yet acknowledged."""
        return tuple(self._inflight)

    @property
    def queued(self) -> tuple[int, ...]:
        """Op ids submitted and not yet flushed."""
        return tuple(c.op_id for d in Direction for c in self._queue[d])

    def stats(self) -> dict[str, Any]:
        """Statistics as a plain dict: ``backend`` (name and settings; the hybrid
        backend's calibration and crossovers), ``rank``, ``flushes``, ``last_flush`` and
        ``cumulative`` (per direction: flushes, ops, failed_ops, pages, spans,
        tensor_refs, rows, copy_calls, kernel_launches, chunks, bytes, timed_bytes,
        seconds, gbps, and by engine: sm_bytes, sm_copies, ce_bytes, ce_copies,
        ce_calls, sm_gbps and ce_gbps (over flushes that used that engine alone),
        max_blocks (SMs the largest launch took), waits), ``plan_cache`` (hits and
        misses of whole plans and of address tables), ``queued`` and ``in_flight`` op
        counts."""
        d: dict[str, Any] = {"backend": self.backend.describe(), "rank": self.rank,
                             "chunk_layers": self.planner.chunk_layers}
        d.update(self._stats.as_dict())
        d["plan_cache"] = dict(self.planner.counters)
        d["queued"] = len(self.queued)
        d["in_flight"] = len(self._inflight)
        return d
