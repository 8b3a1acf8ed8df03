"""The reference scheduler's loop: :class:`ReferenceScheduler` (see :mod:`kvtier.scheduler`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from operator import attrgetter
from time import perf_counter
from typing import Any

from kvtier.fsm import Direction, TransferCommand
from kvtier.fsm.request.batch import OK, SHORT

from ..replay.costmodel import CostModel
from ..tiered import Admission, Reservation, TieredCache
from .executor import Clock, Executor, InstantExecutor
from .requests import SchedRequest, SchedulerStalled, StepPlan, as_index, check_fresh
from .retraction import Retractions
from .stats import RunStats, TimedCache

__all__ = ["ReferenceScheduler", "DEFAULT_MAX_IDLE_STEPS"]

DEFAULT_MAX_IDLE_STEPS = 100_000
"""Iterations in a row without progress (no forward pass, arrival or ended request) after which
:meth:`ReferenceScheduler.run` raises :class:`SchedulerStalled` (a lost completion is not awaited forever)."""

_ADMITTED = attrgetter("admitted_order")


class ReferenceScheduler(Retractions):
    """Continuous batching with chunked prefill over a :class:`TieredCache`.

    Args:
        cache: the cache to drive.
        executor: runs transfers and forward passes (default: metadata only).
        token_budget: tokens per step, prefill and decode together (default 8,192).
        cost: the step-time model (:class:`CostModel`).
        align_chunks: end a prefill chunk at the prompt's last full unit when the layout
            has continuation-state groups, so the state there can be checkpointed.
        clock: measured time (``None``: time is modeled by ``cost``); ``stats.modeled_s``
            is kept either way.
        max_idle_steps: iterations in a row without progress before :meth:`run` raises
            :class:`SchedulerStalled` (default :data:`DEFAULT_MAX_IDLE_STEPS`).

    Raises:
        ConfigError: ``token_budget`` or ``max_idle_steps`` not an int >= 1.
    """

    def __init__(self, cache: TieredCache, executor: Executor | None = None, *, token_budget: int = 8192,
                 cost: CostModel | None = None, align_chunks: bool = True,
                 max_idle_steps: int = DEFAULT_MAX_IDLE_STEPS, clock: Clock | None = None) -> None:
        token_budget = as_index(token_budget, "token_budget", 1, 1 << 40)
        self.max_idle_steps = as_index(max_idle_steps, "max_idle_steps", 1, 1 << 40)
        self.cache = cache
        self._real_cache = cache
        self.executor: Executor = executor or InstantExecutor(cache.core.world_size)
        self.token_budget = token_budget
        self.cost = cost or CostModel()
        self.align = cache.layout.alignment
        self.align_chunks = align_chunks and bool(cache.layout.state_groups)
        self.stats = RunStats()
        self._timed = TimedCache(cache, self.stats)
        self.cache = self._timed  # type: ignore[assignment]
        self.clock = clock
        self.now = clock.now() if clock is not None else 0.0
        self._order = 0
        self._group_bytes = {g.name: g.page_bytes for g in cache.layout.groups}
        # the queues of one run (set by run)
        self._pending: deque[SchedRequest] = deque()
        self._waiting: deque[SchedRequest] = deque()
        self._retracted: deque[SchedRequest] = deque()
        self._live: dict[str, SchedRequest] = {}
        self._running: list[SchedRequest] = []
        self._due: list[SchedRequest] = []  # generated every token while loading: they end once running
        # a failed resume is tried again only once capacity may have come back: a request
        # event or a completion since (``_changes``), or a smaller first chunk
        self._changes = 0
        self._resume_failed: tuple[str, int, int] | None = None  # (request, _changes, chunk)
        # a failed admission likewise, while nothing it depends on has changed either: no request event
        # or completion, no node lifecycle event (a node published, evicted, demoted ...), no pool's
        # count of pages in use (a deferred free, a duplicate given back, a decode token's page)
        self._admit_failed: tuple[str, tuple[int, ...], int] | None = None  # (request, _capacity_mark, chunk)

    # -- helpers ---------------------------------------------------------------------
    def _command_bytes(self, cmd: TransferCommand) -> int:
        return sum(t.pages * self._group_bytes[t.group] for t in cmd.transfers)

    def _capacity_mark(self) -> tuple[int, ...]:
        """What an admission's outcome depends on, as counters that move whenever it may change:
        request events and completions seen, node lifecycle triggers fired, every pool's pages in use."""
        core = self._real_cache.core
        mark = [self._changes, core.stats.triggers]
        mark.extend(a.used for a in core.device.values())
        if core.host is not None:
            mark.extend(a.used for a in core.host.values())
        return tuple(mark)

    def _chunk_end(self, r: SchedRequest, start: int, budget: int) -> int:
        end = min(r.kv_target, start + budget)
        if self.align_chunks:
            boundary = (r.kv_target // self.align) * self.align
            if start < boundary < end:
                end = boundary
        return end

    def _submit(self) -> float:
        out = self.cache.poll()
        load_bytes = 0
        for cmd in out.commands:
            nbytes = self._command_bytes(cmd)
            if cmd.direction is Direction.LOADBACK:
                load_bytes += nbytes
                self.stats.loadback_bytes += nbytes
                self.stats.loadback_pages += cmd.pages
            else:
                self.stats.writeback_bytes += nbytes
                self.stats.writeback_pages += cmd.pages
        self.executor.submit(out.commands)
        self._changes += bool(out.events)
        for e in out.events:
            if e.state == "aborted":
                self._on_abort(e.request_id, e.reason or "aborted")
            elif e.state == "waiting" and e.request_id in self._live:
                self._requeue(self._live[e.request_id])
        return self.cost.transfer_s(load_bytes)

    def _requeue(self, r: SchedRequest) -> None:
        """Its loadback failed: it recomputes from the start (what it decoded since a resume too), first in line."""
        if r in self._running:
            self._running.remove(r)
        if r.resume_to and r.tokens > r.kv_target:
            r.resume_to = r.kv_target = r.tokens
        r.tokens = 0
        if r not in self._waiting:
            self._waiting.appendleft(r)

    def _on_abort(self, rid: str, reason: str) -> None:
        r = self._live.pop(rid, None)
        if r is None:
            return
        r.aborted = reason
        r.done = True
        self.stats.aborts += 1
        self.stats.abort_reasons[reason] = self.stats.abort_reasons.get(reason, 0) + 1
        for q in (self._waiting, self._retracted):
            if r in q:
                q.remove(r)

    def _deliver(self) -> None:
        for c in self.executor.collect():
            self.cache.complete(c)
            self._changes += 1

    def _decode_unit_key(self, r: SchedRequest, index: int) -> Hashable:
        return (r.request_id, "u", index)

    def _units_for(self, r: SchedRequest, tokens: int) -> Sequence[Hashable]:
        """Unit keys beyond the prompt's full units that ``tokens`` completes."""
        have = len(r.units) + r.decode_units
        full = tokens // self.align
        out = [self._decode_unit_key(r, i) for i in range(have, full)]
        r.decode_units += len(out)
        return out

    def _sample(self) -> None:
        core = self.cache.core
        dev = sum(a.used for a in core.device.values()) / max(1, sum(a.capacity for a in core.device.values()))
        host = (sum(a.used for a in core.host.values()) / max(1, sum(a.capacity for a in core.host.values()))
                if core.host is not None else 0.0)
        rate = self.stats.hit_tokens / self.stats.prompt_tokens if self.stats.prompt_tokens else 0.0
        self.stats.timeline.append((self.now, rate, dev, host))

    # -- the loop --------------------------------------------------------------------
    def run(self, requests: Sequence[SchedRequest], *, progress: Callable[[int], None] | None = None,
            max_steps: int | None = None, on_step: Callable[[], None] | None = None) -> RunStats:
        """Run every request to its end; returns the statistics.

        Each step: arrivals, completions and deadlines, decode tokens (:meth:`_decode`), prefill chunks
        (:meth:`_continue_prefills`), resumptions and admissions (:meth:`_resume_and_admit`), then either the
        forward pass and its results (:meth:`_forward`, :meth:`_step_results`) or, with nothing to run, :meth:`_idle`.

        Every loop is bounded: the requests are checked before anything runs, and a run that makes no progress
        for ``max_idle_steps`` iterations, or runs more than ``16 * (prompt + output tokens of all requests) +
        max_idle_steps`` iterations (a retraction livelock), raises :class:`SchedulerStalled`.

        Args:
            requests: the requests, by arrival time (fresh: never run before).
            progress: called with the number of requests that ended since the last call.
            max_steps: stop after this many steps (``None``: until every request ended).
            on_step: called before every iteration, where the cache is consistent (e.g. a metrics collector's step).

        Raises:
            ConfigError: a request that is not a :class:`SchedRequest`, has a bad field (see :meth:`SchedRequest.check`),
                was run before, or repeats a request id; a bad ``max_steps``. Nothing has run then.
            SchedulerStalled: the run stopped making progress or passed its bound.
        """
        if max_steps is not None:
            max_steps = as_index(max_steps, "max_steps", 0, 1 << 62)
        bound = 16 * check_fresh(requests) + self.max_idle_steps
        self._pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.request_id)))
        self._waiting = deque()
        self._retracted = deque()
        self._resume_failed = None
        self._admit_failed = None
        self._live = {}
        self._running, self._due = [], []
        ended_before = 0
        iterations = idle = ended_seen = 0
        while self._pending or self._live:
            if on_step is not None:
                on_step()
            if max_steps is not None and self.stats.steps >= max_steps:
                break
            iterations += 1
            idle += 1
            if self.stats.finished + self.stats.aborts > ended_seen:
                ended_seen, idle = self.stats.finished + self.stats.aborts, 0
            if idle > self.max_idle_steps:
                raise SchedulerStalled(f"no forward pass, arrival or ended request for {self.max_idle_steps:,} "
                                       f"iterations (max_idle_steps)", iterations, list(self._live))
            if iterations > bound:
                raise SchedulerStalled(f"the run passed its bound of {bound:,} iterations (16 per token of "
                                       f"work plus max_idle_steps)", iterations, list(self._live))
            if self._arrivals():
                idle = 0
            self._deliver()
            self.cache.advance_step()
            self._submit()
            self._running[:] = [r for r in self._running if r.request_id in self._live and not r.done]
            plan = StepPlan(self.token_budget)
            self._decode(plan)
            self._continue_prefills(plan)
            self._resume_and_admit(plan)
            load_s = self._submit()
            if not plan.batch:
                self._idle(plan.blocked)
                continue
            idle = 0
            self._forward(plan.batch, load_s)
            self._step_results(plan.batch)
            self._due += [r for r, _ in plan.batch if not r.done and r.generated >= max(1, r.output_tokens)
                          and r.tokens >= r.kv_target and self.cache.state(r.request_id) == "loading"]
            self._submit()
            if self.stats.steps % 64 == 0:
                self._sample()
            ended = self.stats.finished + self.stats.aborts
            if progress is not None and ended > ended_before:
                progress(ended - ended_before)
                ended_before = ended
        self._drain()
        return self.stats

    # -- the phases of a step ----------------------------------------------------------
    def _arrivals(self) -> int:
        """Requests that arrived by now join the waiting queue (with nothing live, time
        jumps to the next arrival); returns how many arrived."""
        pending = self._pending
        if self.clock is not None:
            self.now = self.clock.now()
        if not self._live and pending and pending[0].arrival_s > self.now:
            self._jump(pending[0].arrival_s)
        arrived = 0
        while pending and pending[0].arrival_s <= self.now:
            r = pending.popleft()
            self._live[r.request_id] = r
            self._waiting.append(r)
            self.stats.prompt_tokens += r.prompt_tokens
            arrived += 1
        return arrived

    def _decode(self, plan: StepPlan) -> None:
        """One decode token for each decoding request, oldest admission first, in one batched
        :meth:`TieredCache.step` (one whose last token came while it was loading finishes first); when pages
        run out, retract the newest decoding request not yet in the batch (the batch goes on after it)."""
        running, due = self._running, self._due
        for r in (r for r in due if not r.done and self.cache.state(r.request_id) == "running"):
            self._finish(r)
        due[:] = [r for r in due if not r.done and self.cache.state(r.request_id) == "loading"]
        pending = sorted((r for r in running if r.tokens >= r.kv_target and not r.done and r not in due), key=_ADMITTED)
        while pending:
            if len(pending) > plan.budget:
                del pending[max(0, plan.budget):]
                if not pending:
                    return
            self._timed.decode = True
            out = self.cache.step(reserve=[(r.request_id, 1) for r in pending], stop_on_short=True)
            self._timed.decode = False
            out.raise_first()
            status = out.reserve_status
            if out.ok:  # every token fitted: the whole batch runs
                plan.batch.extend([(r, 1) for r in pending])
                plan.budget -= len(pending)
                return
            batch, pending = pending, []
            for i, (r, st) in enumerate(zip(batch, status)):
                if st == OK:
                    plan.add(r, 1)
                elif st == SHORT:
                    if self._decode_short(r, plan):
                        plan.add(r, 1)
                    present = {id(x) for x in running}  # a retraction may have removed some
                    pending = [x for x in batch[i + 1:] if id(x) in present]
                    break

    def _continue_prefills(self, plan: StepPlan) -> None:
        """The next prefill chunk of each running prefill, oldest admission first, in one
        batched :meth:`TieredCache.step` (a request short of pages is blocked; the chunks
        after it are sized again with the budget it left)."""
        pending = sorted((r for r in self._running if r.tokens < r.kv_target), key=lambda r: r.admitted_order)
        if not pending or plan.budget <= 0:
            return
        states = self.cache.states([r.request_id for r in pending])
        pending = [r for r, st in zip(pending, states) if st in ("running", "loading")]
        while pending and plan.budget > 0:
            batch: list[tuple[SchedRequest, int]] = []
            budget = plan.budget
            for r in pending:
                if budget <= 0:
                    break
                n = self._chunk_end(r, r.tokens, budget) - r.tokens
                batch.append((r, n))
                budget -= n
            out = self.cache.step(reserve=[Reservation(r.request_id, n) for r, n in batch], stop_on_short=True)
            out.raise_first()
            rest, pending = pending[len(batch):], []
            for i, ((r, n), st) in enumerate(zip(batch, out.reserve_status)):
                if st == OK:
                    plan.add(r, n)
                elif st == SHORT:
                    if not self._never_fits(r):
                        plan.blocked.append(r.request_id)
                    pending = [x for x, _ in batch[i + 1:]] + rest
                    break

    def _resume_and_admit(self, plan: StepPlan) -> None:
        """Resume retracted requests in retraction order, then admit waiting ones in arrival order,
        a requeued one first (a queue stops at the first that does not fit; a failed resume blocks none)."""
        cache = self.cache
        for queue, resume in ((self._retracted, True), (self._waiting, False)):
            while queue and plan.budget > 0:
                r = queue[0]
                if resume and cache.state(r.request_id) != "retracted":
                    break  # its retract writeback is still in flight
                failed = self._resume_failed
                if (resume and failed is not None and failed[:2] == (r.request_id, self._changes)
                        and plan.budget >= failed[2]):
                    plan.blocked.append(r.request_id)  # nothing freed since it failed: it fails again
                    break
                failed_admit = self._admit_failed
                if (not resume and failed_admit is not None and failed_admit[0] == r.request_id
                        and plan.budget >= failed_admit[2] and failed_admit[1] == self._capacity_mark()):
                    plan.blocked.append(r.request_id)  # nothing changed since it failed: it fails again
                    break
                adm = (cache.resume(r.request_id, plan.budget) if resume else
                       cache.admit(r.request_id, r.units, r.prompt_tokens, plan.budget))
                if adm is None:
                    if resume:
                        self._resume_failed = (r.request_id, self._changes, plan.budget)
                    else:
                        self._admit_failed = (r.request_id, self._capacity_mark(), plan.budget)
                    plan.blocked.append(r.request_id)
                    break
                queue.popleft()
                self.executor.admitted(self._real_cache, adm)
                if not resume:
                    self._count_admission(r, adm)
                r.tokens = adm.start_token
                end = self._chunk_end(r, r.tokens, adm.chunk_tokens)
                self._running.append(r)
                plan.add(r, max(1, end - r.tokens))

    def _count_admission(self, r: SchedRequest, adm: Admission) -> None:
        """A first admission: its hits, and its place in the admission order."""
        r.hit_tokens = adm.hit_tokens
        r.device_hit_tokens = adm.device_hit_tokens
        r.history_hit_tokens = adm.history_hit_tokens
        self.stats.hit_tokens += adm.hit_tokens
        self.stats.device_hit_tokens += adm.device_hit_tokens
        self.stats.host_hit_tokens += adm.hit_tokens - adm.device_hit_tokens
        self.stats.history_hit_tokens += adm.history_hit_tokens
        r.admitted_order = self._order
        self._order += 1

    def _idle(self, blocked: list[str]) -> None:
        """Nothing could run this step: abort one victim when every blocked request is short of cache
        and nothing is in flight; abort everything live when the scheduler has stalled; else wait for transfers."""
        cache = self.cache
        if blocked and not cache.in_flight():
            if cache.abort_victim(blocked) is not None:
                self._submit()
                return
        if not cache.in_flight() and not self._pending and not self._waiting and not self._retracted \
                and not self._running and self._live:
            for rid in list(self._live):
                cache.abort(rid, "scheduler stalled")
            self._submit()
            return
        self.stats.steps += 1
        if self._pending and not cache.in_flight():
            self._jump(max(self.now, self._pending[0].arrival_s))

    def _jump(self, t: float) -> None:
        """Idle until ``t``: modeled time jumps; a clock skips the gap."""
        if self.clock is not None:
            self.clock.skip_to(t)
            self.now = self.clock.now()
        else:
            self.now = t

    def _forward(self, batch: list[tuple[SchedRequest, int]], load_s: float) -> None:
        """The forward pass (loadbacks complete layer by layer during it), timed: compute or loadback, the longer."""
        self._deliver()
        self.executor.forward(self._real_cache, [(r.request_id, r.tokens, n) for r, n in batch])
        prefill = sum(n for r, n in batch if r.tokens < r.kv_target)
        decode = sum(n for r, n in batch if r.tokens >= r.kv_target)
        self.stats.prefill_tokens += prefill
        self.stats.decode_tokens += decode
        step_s = max(self.cost.compute_s(prefill, decode), load_s)
        if self.clock is not None:
            self.now = self.clock.now()
        else:
            self.now += step_s
        self.stats.modeled_s += step_s
        self.stats.steps += 1

    def _step_results(self, batch: list[tuple[SchedRequest, int]]) -> None:
        """Report the forward results in one batched :meth:`TieredCache.step` (a request no
        longer computing reports a discarded pass); then finish the requests that are done."""
        live = [(r, n) for r, n in batch if r.request_id in self._live]
        if not live:
            return
        states = self.cache.states([r.request_id for r, _ in live])
        items: list[tuple[Any, ...]] = []
        counted: list[tuple[SchedRequest, int]] = []  # (request, tokens before)
        decode = 0
        align = self.align
        for (r, n), st in zip(live, states):
            rid = r.request_id
            if st != "running" and st != "loading":
                items.append((rid, 0))  # a discarded pass (retracted, requeued, aborting)
                continue
            before = r.tokens
            tokens = r.tokens = before + n
            if tokens % align == 0:
                units = self._units_for(r, tokens) if tokens // align > len(r.units) + r.decode_units else ()
                items.append((rid, n, units, True))
            elif tokens // align > len(r.units) + r.decode_units:
                items.append((rid, n, self._units_for(r, tokens)))
            else:
                items.append((rid, n))
            counted.append((r, before))
            if before >= r.kv_target:
                decode += 1
        t0 = perf_counter()
        out = self._real_cache.step(results=items)
        dt = perf_counter() - t0
        self.stats.kvtier_s += dt
        self.stats.kvtier_decode_s += dt * decode / len(items)  # its decode items' share
        out.raise_first()
        adopted = {out.result_ids[i]: pages for i, pages in out.adopted.items()}
        for r, before in counted:
            if adopted and r.request_id in adopted:
                self.executor.checkpointed(self._real_cache, r.request_id, adopted[r.request_id], r.tokens)
            if before >= r.kv_target and before >= r.prompt_tokens:
                r.generated += 1  # a decode token (what _count_tokens counts then)
            else:
                self._count_tokens(r, before)
            if r.generated >= r.output_tokens and r.generated >= 1 and self.cache.state(r.request_id) == "running":
                self._finish(r)

    def _count_tokens(self, r: SchedRequest, before: int) -> None:
        """Generated tokens after a step that took ``r`` from ``before`` tokens to
        ``r.tokens`` (and the time to its first token)."""
        if before < r.kv_target and r.resume_to:
            pass  # recomputing what it had before it was retracted: no new token
        elif before < r.prompt_tokens <= r.tokens:
            r.generated = 1
            if r.first_token_s is None:
                r.first_token_s = self.now
                self.stats.ttft_s.append(self.now - r.arrival_s)
        elif before >= r.kv_target:
            r.generated += 1

    def _finish(self, r: SchedRequest) -> None:
        adopted = self.cache.finish(r.request_id)
        if adopted:  # the engine fills the checkpoint pages the tree adopted
            self.executor.checkpointed(self._real_cache, r.request_id, adopted, r.tokens)
        r.done = True
        self._live.pop(r.request_id, None)
        self.stats.finished += 1

    def _drain(self) -> None:
        """After the loop: deliver what is still in flight (bounded)."""
        for _ in range(1000):
            if not self.cache.in_flight():
                break
            self._deliver()
            self.cache.advance_step()
            self._submit()
