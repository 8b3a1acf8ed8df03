"""The facade machine: drives the :class:`~kvtier.tiered.TieredCache` facade through a
:class:`~kvtier.testing.plugs.SchedulerAdapter` and a
:class:`~kvtier.testing.plugs.TransferBackend`: requests are admitted, computed,
reserved, finished, retracted, resumed and aborted at any point, with completions
reordered, delayed, failed per rank and expired. An engine subclasses it and overrides
:meth:`FacadeMachine.make_scheduler` / :meth:`FacadeMachine.make_transfer` to run the
same rules and invariants against its own integration.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import initialize

from ..eventlog import attach_active
from ..tiered import TieredCache
from . import _views as views
from .base import FAULT_LEVEL, LAYOUTS, TERMINAL, layout_named, recorded
from .canonical import CanonicalState
from .counter_model import CounterModel
from .drain import check_core_drained, evict_to_full_pools
from .facade_checks import FacadeChecks
from .facade_engine import FacadeTransferRules
from .facade_rules import FacadeRequestRules
from .label_bounds import REASONS, drive_abort_reasons
from .logged import LogCheck
from .models import ModelViolation, liveness_bound
from .plugs import SchedulerAdapter, TransferBackend
from .steps import Step

__all__ = ["FacadeMachine"]


class FacadeMachine(FacadeRequestRules, FacadeTransferRules, FacadeChecks):
    """Drives a :class:`TieredCache` through a :class:`SchedulerAdapter` with a
    :class:`TransferBackend`, checking after every step the core's and the facade's
    invariants plus invariant 12 for the tree and for what running requests read.

    Requests ``r0``..``r2`` have prompts drawn from a small alphabet (shared prefixes,
    splits); their decode units are private. The setup draws the layout (the kit's, with
    or without continuation-state groups, or a preset's), so checkpoints (final and
    chunk) are published and their pages filled, and the example's fault level.
    Reference models (:mod:`kvtier.testing.models`) follow the run: ``layer_ready`` of
    every request and layer against a per-rank model of the delivered layer completions;
    an aborted request's own writeback is never published; admission never reuses the
    whole prompt; ``quiesce`` checks that everything queued is issued, acknowledged and
    released within a bound. :mod:`kvtier.testing.facade_models` checks each admission's
    answer (and that a blocked one moved nothing), what every poll hands out and reports
    (each request's end once, with its reason), and that ``shutdown`` (every request
    aborted, every result and completion back) leaves nothing held; the engine keeps its
    own count of passes out; a refused call must name the request and change nothing.
    The setup may draw a cache without a host tier. Subclass and override
    :meth:`make_scheduler` / :meth:`make_transfer` to test an engine's integration.
    """

    kit_invariants: ClassVar[tuple[str, ...]] = (
        "check_cache_invariants", "check_loaded_equals_written", "check_requests_read_written",
        "check_request_records", "check_layer_ready", "check_views", "check_ended_views", "check_passes_out",
        "check_writeback_split", "check_writeback_quota", "check_counters")
    #: for ``kvtier verify``: the fixed prompts of the requests and their count
    verify_prompts: ClassVar[tuple[tuple[str, ...], ...]] = (("a", "b"), ("a", "c"))
    verify_max_units: ClassVar[int] = 3
    #: for ``kvtier verify``: prompts end one token past their last unit (so the whole
    #: prompt's units may be reused, the case where a later request loads them back)
    verify_tail: ClassVar[bool] = False
    #: whether the setup may draw operation deadlines
    kit_deadlines: ClassVar[bool] = True
    #: whether the setup may draw a cache without a host tier (a plain device cache)
    kit_host_optional: ClassVar[bool] = True

    # -- plug points -----------------------------------------------------------------
    def make_cache(self, world: int, policy: str, dev_units: int, host_units: int | None, deadline: int | None,
                   wb_limit: int) -> TieredCache:
        """The cache under test on ``self.layout`` (the layout the setup drew; ``host_units``
        None: no host tier); override to change the options."""
        extra: dict[str, Any] = {} if self.ended_history is None else {"ended_history": self.ended_history}
        return TieredCache(self.layout, dev_units, host_units, policy=policy, world_size=world,
                           op_deadline_steps=deadline, max_writebacks_in_flight=wb_limit,
                           finish_writeback=self.finish_writeback, history_replay=self.history_replay, **extra)

    def make_scheduler(self, cache: TieredCache) -> SchedulerAdapter:
        """The scheduler adapter (override to plug in an engine's scheduler)."""
        return SchedulerAdapter(cache)

    def make_transfer(self, world: int, num_layers: int) -> TransferBackend:
        """The transfer backend (override to plug in an engine's transfer engine)."""
        return TransferBackend(world, num_layers)

    @initialize(world=st.sampled_from([1, 2]), policy=st.sampled_from(
        ["write_through", "write_through_selective", "write_back"]), dev_units=st.integers(3, 10),
        host_units=st.integers(2, 10), deadline=st.sampled_from([None, 2, 4]), wb_limit=st.sampled_from([1, 2]),
        layout=st.sampled_from(("kit+state", *LAYOUTS)), faults=FAULT_LEVEL,
        finish_wb=st.sampled_from([None, True, False]), ended=st.sampled_from([None, None, 0, 1, 2]),
        replay=st.sampled_from([False, False, True]), single=st.sampled_from([False, False, True]),
        logged=st.integers(0, 9).map(lambda x: x == 9), host=st.sampled_from([True, True, True, False]))
    @recorded
    def setup(self, world: int, policy: str, dev_units: int, host_units: int, deadline: int | None,
              wb_limit: int, layout: str | None = None, faults: int | None = None,
              finish_wb: bool | None = None, ended: int | None = None, replay: bool = False,
              single: bool = False, logged: bool = False, host: bool = True) -> None:
        """Build the cache. ``ended``: how many forgotten ended requests ``request()`` still
        answers for (``None``: the default); ``replay``: ``history_replay`` admissions;
        ``single``: the scheduler adapter reserves and reports results through the
        single-request calls instead of one-item batches; ``logged``: record the example's
        event log and check it at the end (:mod:`kvtier.testing.logged`); without ``host``, the
        cache has no host tier (``host_units`` is then unused)."""
        if self.world_size is not None and not self.kit_replaying:
            world = self.world_size
        if not self.kit_deadlines:
            deadline = None
        host = host or not self.kit_host_optional
        self.kit_set_args(world=world, policy=policy, dev_units=dev_units, host_units=host_units,
                          deadline=deadline, wb_limit=wb_limit, layout=layout, faults=faults, finish_wb=finish_wb,
                          ended=ended, replay=replay, single=single, logged=logged, host=host)
        self.finish_writeback = finish_wb
        self.ended_history, self.history_replay = ended, replay
        self.kit_fault_level(faults)
        self.layout = layout_named(layout or "kit")
        self.world = world
        self.deadline = deadline
        self.cache = self.make_cache(world, policy, dev_units, host_units if host else None, deadline, wb_limit)
        attach_active(self.cache)  # the event log, when one is recording (kvtier.eventlog)
        self.counters = CounterModel(self.cache)
        self.log = LogCheck.start(self.cache, logged)
        self.sched = self.make_scheduler(self.cache)
        if single:
            self.sched.batched = False
        self.xfer = self.make_transfer(world, self.cache.layout.num_layers)

    def kit_drain(self) -> None:
        """The engine shuts down (:meth:`shutdown`'s procedure: every request aborted, every
        forward result returned, every transfer completed, every command and event polled);
        then ``quiescent()`` must hold, nothing be left on the core
        (:func:`~kvtier.testing.drain.check_core_drained`) and the whole tree evict to full
        pools, every transfer succeeding (:mod:`kvtier.testing.drain`); last, requests
        aborted with more distinct reasons than the metrics' label bound, and the counters
        and metrics checked (:mod:`kvtier.testing.label_bounds`)."""
        if not hasattr(self, "cache"):
            return
        self.xfer_faults_off()
        self._shutdown()
        if not self.cache.quiescent():
            raise ModelViolation("model_drain", "the facade", f"quiescent() is false: {self.cache.outstanding()}")
        check_core_drained(self.cache.core, "the facade's core")
        evict_to_full_pools(self.cache.core, self._settle_all, "the facade's core")
        self._poll()
        if not self.cache.quiescent():
            raise ModelViolation("model_drain", "the facade", f"after evicting: {self.cache.outstanding()}")
        self.counters.check_drained()
        self.aborts_made += drive_abort_reasons(self.cache, self.aborts_made, len(REASONS), self._poll)
        self.counters.check_metrics()

    def xfer_faults_off(self) -> None:
        """Hook: a machine whose transfer backend fails on its own turns that off for the
        drain (the kit's backend fails only when a rule says so)."""

    def _settle_all(self) -> None:
        for _ in range(liveness_bound(len(views.nodes(self.cache.core))) + 2):
            self._pump()
            self._poll()
            if not (self.xfer.ready() or views.outbox(self.cache.core) or views.ops(self.cache.core)):
                return

    def teardown(self) -> None:
        """The drain (:meth:`kit_drain`); then the example's event log, when it recorded one,
        must pass ``kvtier check``."""
        log, self.log = self.log, None
        super().teardown()
        if log is not None:
            log.finish()

    # -- bounded verification ------------------------------------------------------------
    @classmethod
    def verify_setup(cls, world: int = 1, policy: str = "write_through", dev_units: int = 4,
                     host_units: int = 4, deadline: int | None = None, wb_limit: int = 1) -> Step:
        return Step.of("setup", dict(world=world, policy=policy, dev_units=dev_units, host_units=host_units,
                                     deadline=deadline, wb_limit=wb_limit))

    def kit_actions(self) -> list[Step]:
        out: list[Step] = []
        align = self.cache.layout.alignment
        for req, key in enumerate(self.verify_prompts):
            rid = self._rid(req)
            r = views.requests(self.cache).get(rid)
            state = None if r is None else r.state
            # the bounded model: at most 2 forward passes owed per request
            if state is None or ((state == "waiting" or state in TERMINAL) and r is not None and r.owed_forward < 2):
                out.append(Step.of("admit", dict(req=req, key=list(key), chunk=len(key), tail=self.verify_tail)))
            if r is None:
                continue
            if r.owed_forward > 0:
                out.append(Step.of("step_done", dict(req=req, checkpoint=False, discard=False)))
            if state == "running" and r.owed_forward == 0 and r.reserved < self.verify_max_units * align:
                out.append(Step.of("reserve", dict(req=req, units=1)))
            if state == "running" and r.owed_forward == 0:
                out.append(Step.of("finish", dict(req=req)))
                out.append(Step.of("retract", dict(req=req, go=0)))
            if state == "retracted" and r.owed_forward < 2:
                out.append(Step.of("resume", dict(req=req, chunk=len(key))))
            if state not in (None, "aborting", *TERMINAL):
                out.append(Step.of("abort", dict(req=req, go=0)))
        for i, _ in enumerate(self.xfer.ready()):
            out.append(Step.of("deliver", dict(i=i, ok=True)))
            out.append(Step.of("deliver", dict(i=i, ok=False)))
        if self.deadline is not None and views.ops(self.cache.core):
            out.append(Step.of("advance", dict(steps=1)))
        core = self.cache.core
        # poll when it does more than report events and forget ended requests (which
        # kvtier.testing.canonical abstracts away): commands to hand out, writebacks to issue
        if views.outbox(core) or views.writeback_queue(core):
            out.append(Step.of("poll", {}))
        if any(views.device_victim(core, n) and n.state == "backed" for n in views.nodes(core).values()):
            out.append(Step.of("pressure", dict(tier="device", g="kv", n=64)))  # demote everything evictable
        return out

    def kit_canonical(self) -> Hashable:
        return CanonicalState(self).value()
