"""The facade machine: drives the :class:`~kvtier.tiered.TieredCache` facade through a
:class:`~kvtier.testing.plugs.SchedulerAdapter` and a
:class:`~kvtier.testing.plugs.TransferBackend`: requests are admitted, computed,
reserved, finished, retracted, resumed and aborted at any point, with completions
reordered, delayed, failed per rank and expired. An engine subclasses it and overrides
:meth:`FacadeMachine.make_scheduler` / :meth:`FacadeMachine.make_transfer` to run the
same rules and invariants against its own integration.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvtier.fsm import Completion, Direction
from kvtier.fsm.request.batch import OK, REFUSED, SHORT, SKIPPED, Reservation
from kvtier.fsm.errors import (DuplicateCompletion, InvariantViolation, KvtierError, LifecycleError, UnknownOperation,
                               UsageError)
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.lifecycle.machines import request_lifecycle
from kvtier.fsm.node import HOST_VISIBLE, Node
from kvtier.fsm.node.ops import Operation

from ..eventlog import attach_active
from ..tiered import TieredCache
from . import _views as views
from .base import FAULT_LEVEL, LAYOUTS, ROLL, TERMINAL, KitMachine, layout_named, recorded
from .canonical import CanonicalState
from .logged import LogCheck
from .content import check_tree_bytes, content, node_prefix
from .models import LayerModel, ModelViolation, liveness_bound
from .plugs import SchedulerAdapter, TransferBackend
from .pass_model import PassModel, check_chunk_rows, check_reserve
from .view_model import check_facade_views
from .sequence import Step, register_machine

__all__ = ["FacadeMachine"]

_REQS = 3
_RARE = st.integers(0, 4)  # destructive rules act when 0: one draw in five
_ABORT_ALWAYS = frozenset({"loading", "fenced", "finishing", "retracting", "retracted"})


class FacadeMachine(KitMachine):
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
    released within a bound. Subclass and override :meth:`make_scheduler` /
    :meth:`make_transfer` to test an engine's integration.
    """

    kit_invariants: ClassVar[tuple[str, ...]] = (
        "check_cache_invariants", "check_loaded_equals_written", "check_requests_read_written",
        "check_request_records", "check_layer_ready", "check_views", "check_ended_views")
    #: for ``kvtier verify``: the fixed prompts of the requests and their count
    verify_prompts: ClassVar[tuple[tuple[str, ...], ...]] = (("a", "b"), ("a", "c"))
    verify_max_units: ClassVar[int] = 3
    #: for ``kvtier verify``: prompts end one token past their last unit (so the whole
    #: prompt's units may be reused, the case where a later request loads them back)
    verify_tail: ClassVar[bool] = False
    #: whether the setup may draw operation deadlines
    kit_deadlines: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.log: LogCheck | None = None  # the example's recorded event log (setup's logged)
        self.cache: TieredCache
        self.sched: SchedulerAdapter
        self.xfer: TransferBackend
        self.units: dict[str, list[Hashable]] = {}
        self.inflight: dict[int, Operation] = {}
        self.expired: set[int] = set()  # ops their deadline settled (their bytes never move)
        self.world = 1
        self.deadline: int | None = None
        self.fenced: dict[str, dict[str, list[int]]] = {}  # aborting request -> own pages it must keep
        self.layout: CacheLayout = layout_named("kit")
        self.finish_writeback: bool | None = None  # TieredCache(finish_writeback=...): None is its default
        self.ended_history: int | None = None  # TieredCache(ended_history=...): None is its default
        self.history_replay = False  # TieredCache(history_replay=...)
        self.forgotten: set[str] = set()  # request ids the facade forgot once ended
        self.remembered: list[str] = []  # those it must still answer for, oldest first
        self.layer_model = LayerModel()
        self.pass_model = PassModel()
        # an aborted request's own writebacks (poisoned): op -> (request, destination host pages, nodes)
        self.poisoned: dict[int, tuple[str, dict[str, set[int]], list[Node]]] = {}

    # -- plug points -----------------------------------------------------------------
    def make_cache(self, world: int, policy: str, dev_units: int, host_units: int, deadline: int | None,
                   wb_limit: int) -> TieredCache:
        """The cache under test on ``self.layout`` (the layout the setup drew); override to
        change the options."""
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
        host_units=st.integers(2, 10), deadline=st.sampled_from([None, 4]), wb_limit=st.sampled_from([1, 2]),
        layout=st.sampled_from(("kit+state", *LAYOUTS)), faults=FAULT_LEVEL,
        finish_wb=st.sampled_from([None, True, False]), ended=st.sampled_from([None, None, 0, 1, 2]),
        replay=st.sampled_from([False, False, True]), single=st.sampled_from([False, False, True]),
        logged=st.integers(0, 9).map(lambda x: x == 9))
    @recorded
    def setup(self, world: int, policy: str, dev_units: int, host_units: int, deadline: int | None,
              wb_limit: int, layout: str | None = None, faults: int | None = None,
              finish_wb: bool | None = None, ended: int | None = None, replay: bool = False,
              single: bool = False, logged: bool = False) -> None:
        """Build the cache. ``ended``: how many forgotten ended requests ``request()`` still
        answers for (``None``: the default); ``replay``: ``history_replay`` admissions;
        ``single``: the scheduler adapter reserves and reports results through the
        single-request calls instead of one-item batches; ``logged``: record the example's
        event log and check it at the end (:mod:`kvtier.testing.logged`)."""
        if self.world_size is not None and not self.kit_replaying:
            world = self.world_size
        if not self.kit_deadlines:
            deadline = None
        self.kit_set_args(world=world, policy=policy, dev_units=dev_units, host_units=host_units,
                          deadline=deadline, wb_limit=wb_limit, layout=layout, faults=faults, finish_wb=finish_wb,
                          ended=ended, replay=replay, single=single, logged=logged)
        self.finish_writeback = finish_wb
        self.ended_history, self.history_replay = ended, replay
        self.kit_fault_level(faults)
        self.layout = layout_named(layout or "kit")
        self.world = world
        self.deadline = deadline
        self.cache = self.make_cache(world, policy, dev_units, host_units, deadline, wb_limit)
        attach_active(self.cache)  # the event log, when one is recording (kvtier.eventlog)
        self.log = LogCheck.start(self.cache, logged)
        self.sched = self.make_scheduler(self.cache)
        if single:
            self.sched.batched = False
        self.xfer = self.make_transfer(world, self.cache.layout.num_layers)

    # -- helpers -----------------------------------------------------------------------
    @staticmethod
    def _rid(req: int) -> str:
        return f"r{req % _REQS}"

    def _state(self, rid: str) -> str | None:
        r = views.requests(self.cache).get(rid)
        return None if r is None else r.state

    def _unit(self, rid: str, u: int) -> Hashable:
        units = self.units[rid]
        while len(units) <= u:
            units.append(f"{rid}.{len(units)}")
        return units[u]

    def _ppu(self) -> dict[str, int]:
        return views.pages_per_unit(self.cache.core)

    def _sync(self) -> None:
        """Bytes move for every operation that settled since the last step."""
        ops = views.ops(self.cache.core)
        for op_id in sorted(set(self.inflight) - set(ops)):
            op = self.inflight.pop(op_id)
            ok = op.ok and op_id not in self.expired
            self.xfer.apply(op_id, ok)
            if op.command.direction is Direction.LOADBACK:
                self.layer_model.settled(op_id, ok)
            self._check_unpublished(op_id)
        for op_id, op in ops.items():
            self.inflight.setdefault(op_id, op)
        self.pass_model.sync(self.cache)
        self._scrub_freed()

    def _scrub_freed(self) -> None:
        """A page back in its pool holds undefined bytes: its content becomes garbage, so a
        page reused without being written first (a use after free) never shows stale bytes
        that happen to be right (and ``kvtier verify`` never tells states apart by them)."""
        core = self.cache.core
        for store, pools in ((self.xfer.dev, core.device), (self.xfer.host, core.host or {})):
            stale = [k for k, v in store.items() if k[0] in pools and pools[k[0]].is_free(k[1])
                     and not (isinstance(v, tuple) and len(v) == 2 and v[0] == "garbage")]
            for key in stale:  # the model only: an engine's real pools keep their bytes
                dict.__setitem__(store, key, ("garbage", "freed"))

    def _complete(self, ev: Completion) -> None:
        """Deliver one completion, recording it in the layer model."""
        op = views.ops(self.cache.core).get(ev.op_id)
        if op is not None and op.command.direction is Direction.LOADBACK:
            self.layer_model.delivered(ev.op_id, ev.rank, ev.layer, ev.ok)
        self.sched.complete(ev)

    def _check_unpublished(self, op_id: int) -> None:
        """Model: an aborted request's own writeback, once settled, left no host copy."""
        entry = self.poisoned.pop(op_id, None)
        if entry is None:
            return
        rid, dst, op_nodes = entry
        live = views.nodes(self.cache.core)
        for n in op_nodes:
            if live.get(n.node_id) is not n or n.state not in HOST_VISIBLE:
                continue
            for g, pages in dst.items():
                if pages & set(n.host.get(g, ())) or pages & set(n.host_ckpt.get(g, ())):
                    raise ModelViolation("model_aborted_unpublished", f"request {rid!r}",
                                         f"its own writeback op {op_id} was published after the abort "
                                         f"(node {n.node_id} shows host pages of {g!r} it wrote)")

    def _fill_checkpoint(self, rid: str, adopted: dict[str, list[int]] | None) -> None:
        """The engine fills the checkpoint pages the tree adopted with the state at the
        request's terminal (its published units)."""
        if not adopted:
            return
        r = views.requests(self.cache)[rid]
        prefix = tuple(r.units[: r.published])
        ppu = self._ppu()
        for g, pages in adopted.items():
            for j, p in enumerate(pages):
                self.xfer.dev[(g, p)] = content(prefix, g, j, ppu)

    def _expect_refused(self, rid: str, call: Callable[[], Any]) -> None:
        before = self._state(rid)
        try:
            call()
        except (LifecycleError, KvtierError):
            if self._state(rid) != before:
                raise InvariantViolation("state_matches_resources", f"request {rid!r}",
                                         f"a refused call moved it from {before} to {self._state(rid)}") from None
            return
        raise AssertionError(f"request {rid!r} in state {before}: the call was accepted")

    def _write_own(self, rid: str, lo_tokens: int, hi_tokens: int) -> None:
        """The forward pass wrote KV for tokens [lo, hi) into the request's own pages."""
        r = views.requests(self.cache)[rid]
        table = self.cache.page_table(rid)
        ppu = self._ppu()
        align = self.cache.layout.alignment
        for g in views.history_groups(self.cache.core):
            tpp = align // ppu[g]
            own = set(r.own.get(g, ()))
            for j in range(lo_tokens // tpp, -(-hi_tokens // tpp)):
                if j < len(table[g]) and table[g][j] in own:
                    u = j // ppu[g]
                    prefix = tuple(self._unit(rid, k) for k in range(u + 1))
                    self.xfer.dev[(g, table[g][j])] = content(prefix, g, j, ppu)

    def _check_read(self, rid: str, tokens: int) -> None:
        """Invariant 12 for a request: the pages it reads for its full units hold them."""
        table = self.cache.page_table(rid)
        ppu = self._ppu()
        units = tokens // self.cache.layout.alignment
        prefix = tuple(self._unit(rid, k) for k in range(units))
        for g in views.history_groups(self.cache.core):
            for j in range(units * ppu[g]):
                if j >= len(table[g]):
                    raise InvariantViolation("loaded_equals_written", f"request {rid!r}",
                                             f"page table of {g!r} covers {len(table[g])} pages, reads {j + 1}")
                got = self.xfer.dev.get((g, table[g][j]))
                if got != content(prefix, g, j, ppu):
                    raise InvariantViolation("loaded_equals_written", f"request {rid!r}",
                                             f"reads device page {table[g][j]} of {g!r} (position {j}): {got!r}")

    # -- rules -------------------------------------------------------------------------
    @rule(req=st.integers(0, _REQS - 1), key=st.sampled_from(["a", "ab", "abb", "aba", "ba", "abab"]).map(list),
          chunk=st.integers(1, 3), tail=st.booleans())
    @recorded
    def admit(self, req: int, key: list[str], chunk: int, tail: bool) -> None:
        rid = self._rid(req)
        state = self._state(rid)
        align = self.cache.layout.alignment
        prompt = len(key) * align + (1 if tail else 0)
        r = views.requests(self.cache).get(rid)
        if r is not None and (state not in ("waiting", *TERMINAL) or (state in TERMINAL and not r.settled)
                              or (state == "waiting" and not r.settled)):
            self._expect_refused(rid, lambda: self.sched.admit(rid, list(key), prompt, chunk * align))
            return
        self.units[rid] = list(key)
        self._admit(rid, prompt, chunk * align)

    def _admit(self, rid: str, prompt: int, chunk_tokens: int) -> None:
        adm = self.sched.admit(rid, list(self.units[rid]), prompt, chunk_tokens)
        if adm is not None:
            if adm.hit_tokens >= prompt:
                raise ModelViolation("model_whole_prompt", f"request {rid!r}",
                                     f"admission reuses {adm.hit_tokens} of its {prompt} prompt tokens: "
                                     f"the last token must be computed")
            self.layer_model.admitted(rid, adm.wait_ops)
            self._check_read(rid, adm.device_hit_tokens)
        self._sync()

    def _demote(self) -> None:
        """Time passes under memory pressure: every transfer completes successfully, then
        device pressure demotes every evictable backed node (under ``write_back`` it
        queues their writebacks first: a second round demotes them), so host hits follow."""
        core = self.cache.core
        for _ in range(2):
            self._pump()
            core.evict_device({g: 1 << 20 for g in views.history_groups(core)})
            self._sync()

    def _pump(self) -> None:
        """Poll, then deliver every pending completion successfully, oldest op first."""
        self._poll()
        while self.xfer.ready():
            op, rank = self.xfer.ready()[0]
            self._complete(self.xfer.take(op, rank, True))
            self._sync()

    @precondition(lambda self: any(n.state in HOST_VISIBLE for n in views.nodes(self.cache.core).values()))
    @rule(req=st.integers(0, _REQS - 1), i=st.integers(0, 100), chunk=st.integers(1, 3), tail=st.booleans(),
          demote=st.booleans())
    @recorded
    def admit_cached(self, req: int, i: int, chunk: int, tail: bool = True, demote: bool = False) -> None:
        """Admit a prompt that is the prefix of a node with a host copy (host-only nodes
        first, so a loadback), plus one token when ``tail``; with ``demote``, device
        pressure demotes what it can first."""
        rid = self._rid(req)
        state = self._state(rid)
        r = views.requests(self.cache).get(rid)
        if r is not None and (state not in ("waiting", *TERMINAL) or not r.settled):
            return
        if demote:
            self._demote()
        all_nodes = [n for _, n in sorted(views.nodes(self.cache.core).items())]
        nodes = ([n for n in all_nodes if n.state == "host"]
                 or [n for n in all_nodes if n.state in HOST_VISIBLE])
        if not nodes:
            return
        key = [str(u) for u in node_prefix(nodes[i % len(nodes)])]
        align = self.cache.layout.alignment
        self.units[rid] = list(key)
        self._admit(rid, len(key) * align + (1 if tail else 0), chunk * align)

    def _admit_host_hit(self, rid: str, i: int) -> Any:
        """Demote the device, then admit ``rid`` on the prefix of a host-only node (the
        ``i``-th): its request record when the admission started a loadback, else None."""
        self._demote()
        nodes = [n for _, n in sorted(views.nodes(self.cache.core).items()) if n.state == "host"]
        if not nodes:
            return None
        key = [str(u) for u in node_prefix(nodes[i % len(nodes)])]
        align = self.cache.layout.alignment
        self.units[rid] = list(key)
        self._admit(rid, len(key) * align + 1, 3 * align)
        r = views.requests(self.cache).get(rid)
        return r if r is not None and r.state == "loading" else None

    @precondition(lambda self: any(n.state in HOST_VISIBLE for n in views.nodes(self.cache.core).values()))
    @rule(req=st.integers(0, _REQS - 1), i=st.integers(0, 100), layers=st.integers(0, 3))
    @recorded
    def shared_loadback(self, req: int, i: int, layers: int) -> None:
        """Two requests with the same cached prompt arrive while it is on the host only:
        the first one's loadback starts, the first rank delivers ``layers`` layer
        completions of it (the other ranks none yet), then the second request joins it."""
        first, second = self._rid(req), self._rid(req + 1)
        for rid in (first, second):
            r = views.requests(self.cache).get(rid)
            if r is not None and (r.state not in ("waiting", *TERMINAL) or not r.settled):
                return
        r = self._admit_host_hit(first, i)
        if r is None:
            return
        key, align = self.units[first], self.cache.layout.alignment
        self._poll()
        ops = views.ops(self.cache.core)
        for op in sorted(r.ops):
            if op in ops and ops[op].command.direction is Direction.LOADBACK:
                for _ in range(layers):
                    if (op, 0) not in self.xfer.ready():
                        break
                    ev = self.xfer.take(op, 0, True)
                    if ev.layer is None:  # (keep the acknowledgement: the loadback stays in flight)
                        self._complete(ev)
                        self._sync()
                        break
                    self._complete(ev)
                    self._sync()
        self.units[second] = list(key)
        self._admit(second, len(key) * align + 1, 3 * align)

    @precondition(lambda self: any(n.state == "loading" for n in views.nodes(self.cache.core).values()))
    @rule(req=st.integers(0, _REQS - 1), i=st.integers(0, 100), tail=st.booleans())
    @recorded
    def join_loading(self, req: int, i: int, tail: bool = True) -> None:
        """Admit a prompt ending in a node that is being loaded back: the request joins
        the loadback in flight (its layer progress so far, per rank, counts)."""
        rid = self._rid(req)
        r = views.requests(self.cache).get(rid)
        if r is not None and (r.state not in ("waiting", *TERMINAL) or not r.settled):
            return
        nodes = [n for _, n in sorted(views.nodes(self.cache.core).items()) if n.state == "loading"]
        if not nodes:
            return
        key = [str(u) for u in node_prefix(nodes[i % len(nodes)])]
        align = self.cache.layout.alignment
        self.units[rid] = list(key)
        self._admit(rid, len(key) * align + (1 if tail else 0), 3 * align)

    @rule(req=st.integers(0, _REQS - 1), chunk=st.integers(1, 3), tail=st.booleans(), demote=st.booleans(),
          overlap=st.booleans(), load_ok=st.booleans(), wb_fail=_RARE)
    @recorded
    def next_turn(self, req: int, chunk: int, tail: bool, demote: bool = True, overlap: bool = False,
                  load_ok: bool = True, wb_fail: int = 1) -> None:
        """A conversation's next turn: a running request with no forward result owed
        finishes, (with ``demote``) time passes under memory pressure, then the same id
        is admitted with the whole conversation so far as its prompt (a host hit after a
        demotion: a loadback). With ``overlap`` a second forward pass is reserved while
        it loads (overlapped scheduling); without ``load_ok`` every rank then reports its
        loadback failed (the request is fenced while its passes are out). One draw in five
        (``wb_fail`` 0) the finish writeback, if any, fails on every rank; one in five
        (``wb_fail`` 4) the client aborts the request while that writeback is in flight."""
        rid = self._rid(req)
        r = views.requests(self.cache).get(rid)
        if r is not None and r.state == "running" and r.owed_forward > 0:
            self._forward(rid, False, False)  # its forward result comes back first
        if r is None or r.state != "running" or r.owed_forward > 0:
            return
        self._fill_checkpoint(rid, self.sched.finish(rid))
        self._sync()
        if wb_fail == 0 and self._state(rid) == "finishing":
            for op in sorted(views.requests(self.cache)[rid].ops):
                self._finish_op(op, False)
        elif wb_fail == 4 and self._state(rid) == "finishing":  # the client aborts it meanwhile
            self._poll()
            self._abort(rid)
        if demote:
            self._demote()
        if self._state(rid) not in ("finished", None):
            return
        units: list[Hashable] = [str(u) for u in views.requests(self.cache)[rid].units] \
            if rid in views.requests(self.cache) else [str(u) for u in r.units]
        if not units:
            return
        align = self.cache.layout.alignment
        self.units[rid] = units
        self._admit(rid, len(units) * align + (1 if tail else 0), chunk * align)
        r = views.requests(self.cache).get(rid)
        if r is None or r.state != "loading":
            return
        if overlap:
            self._reserve(rid, align)
        if not load_ok:
            ops = views.ops(self.cache.core)
            for op in sorted(r.ops):
                if op in ops and ops[op].command.direction is Direction.LOADBACK:
                    self._finish_op(op, False)

    def _finish_op(self, op: int, ok: bool) -> None:
        """Poll, then deliver every pending completion of ``op`` on every rank with ``ok``."""
        self._poll()
        while True:
            ready = [(o, rank) for o, rank in self.xfer.ready() if o == op]
            if not ready:
                return
            self._complete(self.xfer.take(op, ready[0][1], ok))
            self._sync()

    @rule(req=st.integers(0, _REQS - 1), chunk=st.integers(1, 3), wb_ok=st.booleans(), abort_first=_RARE)
    @recorded
    def preempt(self, req: int, chunk: int, wb_ok: bool = True, abort_first: int = 1) -> None:
        """Preemption under memory pressure: a running request with no forward result
        owed is retracted, its own writeback completes (without ``wb_ok`` every rank
        reports it failed: the request is aborted), device pressure demotes what it can,
        and the request resumes (from the host: a loadback). Two draws in five
        (``abort_first`` 0, or 4 after a poll handed the writeback out) the client aborts
        it while its own writeback is in flight (``retracting``: the writeback is owed, so
        it waits in ``aborting``)."""
        rid = self._rid(req)
        r = views.requests(self.cache).get(rid)
        if r is not None and r.state == "running" and r.owed_forward > 0:
            self._forward(rid, False, False)  # its forward result comes back first
        if r is None or r.state != "running" or r.owed_forward > 0:
            return
        self._fill_checkpoint(rid, self.sched.retract(rid))
        self._sync()
        if abort_first in (0, 4) and self._state(rid) == "retracting":
            if abort_first == 4:  # the writeback already handed out: poisoned, not withdrawn
                self._poll()
            self._abort(rid)
        if not wb_ok:
            for op in sorted(views.requests(self.cache)[rid].ops):
                self._finish_op(op, False)
        self._demote()
        if self._state(rid) != "retracted":
            return
        adm = self.sched.resume(rid, chunk * self.cache.layout.alignment)
        if adm is not None:
            self.layer_model.admitted(rid, adm.wait_ops)
        self._sync()

    @rule(req=st.integers(0, _REQS - 1), checkpoint=st.booleans(), discard=st.booleans(), ahead=st.booleans())
    @recorded
    def step_done(self, req: int, checkpoint: bool, discard: bool, ahead: bool = False) -> None:
        """The forward result of ``req``'s oldest pass out; with ``ahead`` it also names the
        key of the next unit beyond what the pass completes (a decode unit known in
        advance: it counts once its tokens are computed)."""
        self._forward(self._rid(req), checkpoint, discard, ahead)

    def _forward(self, rid: str, checkpoint: bool, discard: bool, ahead: bool = False) -> None:
        r = views.requests(self.cache).get(rid)
        if r is None or r.owed_forward <= 0:
            if r is not None:
                self._expect_refused(rid, lambda: self.sched.step_done(rid, 0, (), False))
            return
        computed = 0
        if r.state in ("running", "loading") and not discard:
            computed = r.reserved - r.tokens
        if r.state == "running":
            self._check_read(rid, r.tokens)
        if computed:
            check_chunk_rows(self.cache, rid, r.tokens, computed)
            self._write_own(rid, r.tokens, r.tokens + computed)
        align = self.cache.layout.alignment
        full = (r.tokens + computed) // align + (1 if ahead else 0)
        new = [self._unit(rid, u) for u in range(len(r.units), full)] if full > len(r.units) else []
        prefix = tuple(self._unit(rid, k) for k in range(r.tokens // align))
        ppu = self._ppu()
        self.pass_model.check_before_result(self.cache, rid, self.xfer.dev,
                                            lambda g, j: content(prefix, g, j, ppu))
        self._fill_checkpoint(rid, self.sched.step_done(rid, computed, new, checkpoint))
        self._sync()

    @rule(req=st.integers(0, _REQS - 1), units=st.integers(0, 2))
    @recorded
    def reserve(self, req: int, units: int) -> None:
        """Reserve ``units`` units for the next pass (0: one token, a decode step)."""
        rid = self._rid(req)
        state = self._state(rid)
        if state is None:
            return
        tokens = units * self.cache.layout.alignment or 1
        if state not in ("running", "loading"):
            self._expect_refused(rid, lambda: self.sched.reserve(rid, tokens))
            return
        self._reserve(rid, tokens)

    def _reserve(self, rid: str, tokens: int) -> None:
        """``reserve``, checked against :func:`~kvtier.testing.pass_model.check_reserve`."""
        r = views.requests(self.cache)[rid]
        before = (r.reserved, r.tokens, r.passes, r.results)
        got = self.sched.reserve(rid, tokens)
        check_reserve(self.cache, rid, before, got is not None, tokens)
        self._sync()

    def _lifecycle_call(self, rid: str, legal: bool, call: Callable[[], Any]) -> None:
        if legal:
            call()
        else:
            self._expect_refused(rid, call)
        self._sync()

    @rule(req=st.integers(0, _REQS - 1))
    @recorded
    def finish(self, req: int) -> None:
        rid = self._rid(req)
        r = views.requests(self.cache).get(rid)
        if r is not None and r.state == "running" and r.owed_forward > 0:
            self._forward(rid, False, False)  # the last forward result first
        if r is not None:  # finishing is legal once no forward result is owed
            self._lifecycle_call(rid, r.state == "running" and r.owed_forward == 0,
                                 lambda: self._fill_checkpoint(rid, self.sched.finish(rid)))

    @rule(req=st.integers(0, _REQS - 1), go=_RARE)
    @recorded
    def retract(self, req: int, go: int = 0) -> None:
        rid = self._rid(req)
        if go == 0 and self._state(rid) is not None:
            r = views.requests(self.cache).get(rid)
            # (refused while a forward result is owed: the forward fence, invariant 16)
            legal = r is not None and r.state == "running" and r.owed_forward == 0
            self._lifecycle_call(rid, legal, lambda: self._fill_checkpoint(rid, self.sched.retract(rid)))

    @rule(req=st.integers(0, _REQS - 1), chunk=st.integers(1, 3), demote=st.booleans())
    @recorded
    def resume(self, req: int, chunk: int, demote: bool = False) -> None:
        """Resume (with ``demote``: after device pressure, so its terminal is likely host
        only and resuming loads it back)."""
        rid = self._rid(req)
        state = self._state(rid)
        if state is None:
            return
        if demote and state == "retracted":
            self._demote()
        align = self.cache.layout.alignment

        def call() -> None:
            adm = self.sched.resume(rid, chunk * align)
            if adm is not None:
                self.layer_model.admitted(rid, adm.wait_ops)

        self._lifecycle_call(rid, state == "retracted", call)

    @rule(req=st.integers(0, _REQS - 1), go=_RARE)
    @recorded
    def abort(self, req: int, go: int = 0) -> None:
        """Abort: one draw in five while running or waiting, always while the request
        waits on a transfer or a forward result (``loading``, ``fenced``, ``finishing``,
        ``retracting``) or is ``retracted``, whose aborts are the rarer paths."""
        rid = self._rid(req)
        state = self._state(rid)
        if state is not None and (go == 0 or state in _ABORT_ALWAYS):
            self._abort(rid)

    def _abort(self, rid: str) -> None:
        """``abort(rid)``, legal or refused as its state says, with the bookkeeping of the
        models (its own writebacks poisoned, the pages it must keep while aborting)."""
        state = self._state(rid)
        if state is not None:
            r = views.requests(self.cache)[rid]
            own = {g: list(p) for g, p in r.own.items() if p}
            ops = views.ops(self.cache.core)
            mine = {op: ops[op] for op in r.ops if op in ops and ops[op].command.direction is Direction.WRITEBACK}
            self._lifecycle_call(rid, state not in ("aborting", *TERMINAL), lambda: self.sched.abort(rid))
            if self._state(rid) in ("aborting", "aborted"):
                for op_id, op in mine.items():
                    dst: dict[str, set[int]] = {}
                    for t in op.command.transfers:
                        dst.setdefault(t.group, set()).update(t.dst_pages)
                    self.poisoned[op_id] = (rid, dst, list(op.nodes))
                    if op_id not in views.ops(self.cache.core):  # the abort settled it: check now
                        self._check_unpublished(op_id)
            if self._state(rid) == "aborting":
                self.fenced[rid] = own

    @precondition(lambda self: any(n.state in HOST_VISIBLE for n in views.nodes(self.cache.core).values()))
    @rule(req=st.integers(0, _REQS - 1), i=st.integers(0, 100), ok=st.booleans(), overlap=st.booleans(),
          layers=st.integers(0, 3), results_first=st.booleans())
    @recorded
    def abort_loading(self, req: int, i: int, ok: bool, overlap: bool, layers: int = 0,
                      results_first: bool = False) -> None:
        """A client aborts a request while its loadback is in flight: a cached prompt is
        admitted after device pressure (a host hit: ``loading``), with ``overlap`` a second
        pass is reserved, the first rank delivers ``layers`` layer completions, the request
        is aborted (``aborting``: the loadback is owed), then the loadback completes on
        every rank (``ok``) or fails; the passes out return after that (before it, so the
        loadback is the last thing owed, with ``results_first``)."""
        rid = self._rid(req)
        r = views.requests(self.cache).get(rid)
        if r is not None and (r.state not in ("waiting", *TERMINAL) or not r.settled):
            return
        r = self._admit_host_hit(rid, i)
        if r is None:
            return
        if overlap:
            self._reserve(rid, 1)
        self._poll()
        loads = [op for op in sorted(r.ops) if op in views.ops(self.cache.core)
                 and views.ops(self.cache.core)[op].command.direction is Direction.LOADBACK]
        for op in loads[:1]:
            for _ in range(layers):
                if (op, 0) not in self.xfer.ready():
                    break
                ev = self.xfer.take(op, 0, True)
                self._complete(ev)
                self._sync()
                if ev.layer is None:
                    break
        self._abort(rid)
        if results_first:
            r = views.requests(self.cache).get(rid)
            while r is not None and r.owed_forward > 0:
                self._forward(rid, False, False)
        for op in loads:
            self._finish_op(op, ok)

    @precondition(lambda self: self.world > 1 and any(
        op.command.direction is Direction.LOADBACK for op in views.ops(self.cache.core).values()))
    @rule(i=st.integers(0, 100))
    @recorded
    def late_rank_fails(self, i: int) -> None:
        """Two ranks load back: the last rank delivers its layer completions, then the first
        rank delivers all of its own and its acknowledgement fails, while the last rank's is
        still out. The loadback is in flight with every layer reported on every rank, but
        failed: ``layer_ready`` must be false for its waiters (the per-rank layer model)."""
        self._poll()
        loads = sorted(op for op, o in views.ops(self.cache.core).items()
                       if o.command.direction is Direction.LOADBACK)
        if not loads:
            return
        op = loads[i % len(loads)]
        last = self.world - 1
        for _ in range(len(self.xfer.layers)):
            if (op, last) not in self.xfer.ready():
                break
            ev = self.xfer.take(op, last, True)
            self._complete(ev)
            self._sync()
            if ev.layer is None:
                return
        while (op, 0) in self.xfer.ready():
            ev = self.xfer.take(op, 0, True)
            self._complete(Completion(ev.op_id, ev.rank, ev.layer is not None, ev.layer))
            self._sync()
            if ev.layer is None:
                return

    @rule(mask=st.integers(0, 2 ** _REQS - 1), settle=st.booleans())
    @recorded
    def abort_victim(self, mask: int, settle: bool) -> None:
        """The scheduler's way out of a capacity deadlock: ``abort_victim`` among the
        requests of ``mask`` that may be aborted (with ``settle``, after the forward results
        owed came back and every transfer completed). Model: it aborts the one with the
        most tokens (prompt or computed; ties to the smallest id), at once, exactly when
        nothing is in flight and no forward result is owed, and otherwise changes nothing."""
        if settle:
            for rid, r in sorted(views.requests(self.cache).items()):
                while r.owed_forward > 0:
                    self._forward(rid, False, False)
            self._pump()
        reqs = views.requests(self.cache)
        blocked = [self._rid(i) for i in range(_REQS) if mask >> i & 1 and self._rid(i) in reqs
                   and reqs[self._rid(i)].state not in ("aborting", *TERMINAL)]
        busy = bool(views.ops(self.cache.core)) or any(r.owed_forward > 0 for r in reqs.values())
        want = None if busy or not blocked else min(
            blocked, key=lambda rid: (-max(reqs[rid].tokens, reqs[rid].prompt_tokens), rid))
        before = {rid: r.state for rid, r in reqs.items()}
        got = self.cache.abort_victim(blocked)
        after = {rid: r.state for rid, r in views.requests(self.cache).items()}
        if want is not None:
            before[want] = "aborted"
        if got != want or after != before:
            raise ModelViolation("model_views", f"abort_victim({blocked})",
                                 f"aborted {got!r} (states {after}); the model: {want!r} (states {before})")
        self._sync()

    @rule(mask=st.integers(1, 2 ** (_REQS + 1) - 1), units=st.integers(0, 2), stop=st.booleans())
    @recorded
    def batch_reserve(self, mask: int, units: int, stop: bool) -> None:
        """One batched step reserving for several requests at once (bit ``_REQS`` of ``mask``
        adds an id the cache does not know, refused), ``units`` each (0: one token), with
        ``stop_on_short`` when ``stop``. Model: each item is all or nothing on its own
        (:func:`check_reserve` for every request); a refused item raises its own error and
        changes nothing; after a short item with ``stop`` the rest are skipped."""
        reqs = views.requests(self.cache)
        rids = [self._rid(i) for i in range(_REQS) if mask >> i & 1 and self._rid(i) in reqs]
        if mask >> _REQS & 1:
            rids.insert(len(rids) // 2 + 1, "unknown")
        tokens = units * self.cache.layout.alignment or 1
        before = {rid: (r.reserved, r.tokens, r.passes, r.results) for rid, r in reqs.items()}
        states = {rid: r.state for rid, r in reqs.items()}
        out = self.cache.step(reserve=[Reservation(rid, tokens) for rid in rids], stop_on_short=stop)
        short = False
        for i, (rid, st_) in enumerate(zip(out.reserve_ids, out.reserve_status)):
            legal = rid in states and states[rid] in ("running", "loading")
            expect = ({SKIPPED} if short else {OK, SHORT}) if legal else ({SKIPPED} if short else {REFUSED})
            if rid != rids[i] or st_ not in expect:
                raise ModelViolation("model_reserve", f"batch item {i} ({rid!r})",
                                     f"status {st_!r}, expected one of {sorted(expect)} (items {rids})")
            if st_ == REFUSED and not isinstance(out.errors.get(("reserve", i)), (UsageError, LifecycleError)):
                raise ModelViolation("model_reserve", f"batch item {i} ({rid!r})",
                                     f"refused with {out.errors.get(('reserve', i))!r}")
            short = short or (st_ == SHORT and stop)
            if rid in before:
                check_reserve(self.cache, rid, before[rid], st_ == OK, tokens)
        for rid in set(before) - set(rids):  # requests not in the batch: untouched
            check_reserve(self.cache, rid, before[rid], False, tokens)
        self._sync()

    @precondition(lambda self: bool(self.xfer.ready()) or bool(views.outbox(self.cache.core)))
    @rule(i=st.integers(0, 1000), roll=ROLL)
    @recorded
    def deliver(self, i: int, roll: int = 0, ok: bool | None = None) -> None:
        """Poll (submitting new commands), then deliver one pending completion."""
        if ok is None:
            ok = not self.kit_fail(roll)
        self.kit_set_args(i=i, ok=ok)
        self._poll()
        ready = self.xfer.ready()
        if not ready:
            return
        op, rank = ready[i % len(ready)]
        ev = self.xfer.take(op, rank, ok)
        core = self.cache.core
        late = op not in views.ops(core)
        absorbed = core.stats.absorbed_late_completions
        self._complete(ev)
        if late and core.stats.absorbed_late_completions != absorbed + 1:
            raise InvariantViolation("operation_ends_once", f"op {op}", "a completion for a settled op was not absorbed")
        in_flight = op in views.ops(core)
        try:  # the same completion again: refused while in flight, absorbed once settled
            self.sched.complete(ev)
        except (DuplicateCompletion, UnknownOperation):
            if not in_flight:
                raise InvariantViolation("operation_ends_once", f"op {op}",
                                         f"duplicate {ev} of a settled op was refused, not absorbed") from None
        else:
            if in_flight:
                raise InvariantViolation("operation_ends_once", f"op {op}", f"duplicate {ev} was accepted")
        self._sync()

    @precondition(lambda self: self.deadline is not None)
    @rule(steps=st.integers(1, 3))
    @recorded
    def advance(self, steps: int) -> None:
        before = set(views.ops(self.cache.core))
        self.sched.advance_step(steps)
        self.expired |= before - set(views.ops(self.cache.core))  # only deadlines settle here
        self._sync()

    @rule(go=_RARE)
    @recorded
    def drain(self, go: int = 0) -> None:
        """Poll, then deliver every pending completion successfully, oldest op first."""
        if go == 0:
            self._pump()

    @rule()
    @recorded
    def poll(self) -> None:
        self._poll()

    def _poll(self) -> None:
        before = set(views.requests(self.cache))
        keep = views.ended_history(self.cache)
        self.remembered = [rid for rid in self.remembered if rid not in before]  # admitted again: live
        out = self.sched.poll()
        for rid in sorted(before - set(views.requests(self.cache))):  # forgotten by this poll, in id order
            self.forgotten.add(rid)
            self.remembered.append(rid)
            if len(self.remembered) > keep:
                del self.remembered[0]
        for cmd in out.commands:
            self.xfer.submit(cmd)
        lc = request_lifecycle()
        for ev in out.events:
            if ev.state not in lc.spec.state_names:
                raise InvariantViolation("state_matches_resources", f"request {ev.request_id!r}",
                                         f"reported in unknown state {ev.state!r}")
        self._sync()

    @rule(tier=st.sampled_from(["device", "device", "host"]), g=st.integers(0, 3), n=st.integers(1, 16))
    @recorded
    def pressure(self, tier: str, g: int | str, n: int) -> None:
        """Evict ``n`` pages of a history group (by index; a name in older sequences)."""
        core = self.cache.core
        history = views.history_groups(core)
        g = g if isinstance(g, str) else history[g % len(history)]
        if tier == "device":
            core.evict_device({g: n})
        else:
            core.evict_host({g: n})
        self._sync()

    @rule()
    @recorded
    def quiesce(self) -> None:
        """Liveness: the forward results owed come back, then rounds of "poll, deliver
        everything successfully"; within :func:`~kvtier.testing.models.liveness_bound`
        rounds nothing is queued or in flight, and no request still waits in ``loading``,
        ``finishing``, ``retracting`` or ``aborting``."""
        for rid, r in sorted(views.requests(self.cache).items()):
            while r.owed_forward > 0:
                self._forward(rid, False, False)
        core = self.cache.core
        bound = liveness_bound(len(views.nodes(core)))
        for _ in range(bound):
            self._poll()
            if not self.xfer.ready() and not views.writeback_queue(core) and not views.outbox(core):
                break
            self._pump()
        stuck = {rid: r.state for rid, r in views.requests(self.cache).items()
                 if r.state in ("loading", "finishing", "retracting", "aborting")}
        left = views.writeback_queue(core)
        if left or views.ops(core) or stuck:
            raise ModelViolation("model_liveness", "the facade",
                                 f"after {bound} rounds: writebacks queued {sorted(left)}, operations in "
                                 f"flight {sorted(views.ops(core))}, requests waiting {stuck}")

    def teardown(self) -> None:
        """The example's event log, when it recorded one, must pass ``kvtier check``."""
        log, self.log = self.log, None
        if log is not None:
            log.finish()

    # -- invariants --------------------------------------------------------------------
    def check_layer_ready(self) -> None:
        """Model: ``layer_ready`` of every request and layer agrees with the per-rank model."""
        if not hasattr(self, "cache"):
            return
        ops = views.ops(self.cache.core)
        for rid, r in views.requests(self.cache).items():
            for layer in range(self.cache.layout.num_layers):
                want = self.layer_model.expect(rid, r.state, layer, self.world, ops)
                got = self.sched.layer_ready(rid, layer)
                if got != want:
                    raise ModelViolation("model_layer_ready", f"request {rid!r} ({r.state})",
                                         f"layer_ready(layer {layer}) is {got}, the per-rank model says {want} "
                                         f"(progress {self.layer_model.progress}, waits "
                                         f"{sorted(self.layer_model.waits.get(rid, ()))})")

    def check_ended_views(self) -> None:
        """Model: the facade forgets an ended request once a poll reported it (``_poll``
        records which, in order); ``request(rid)`` then still answers, with its terminal
        state, for the last ``ended_history`` requests forgotten (an id admitted again is
        live, and no longer counts among them), and raises UsageError for the others."""
        if not hasattr(self, "cache"):
            return
        now = views.requests(self.cache)
        for rid in sorted(self.forgotten - set(now)):  # (an id admitted again is live)
            try:
                state = self.cache.request(rid).state
            except UsageError:
                state = None
            if (state is not None) != (rid in self.remembered) or (state is not None and state not in TERMINAL):
                raise ModelViolation("model_views", f"request({rid!r})",
                                     f"answers {state!r} for a forgotten request; it must answer for "
                                     f"{self.remembered} (the last {views.ended_history(self.cache)} forgotten and "
                                     f"not admitted since, oldest first)")

    def check_views(self) -> None:
        """Model: the facade's read-only answers (:mod:`kvtier.testing.view_model`)."""
        if hasattr(self, "cache"):
            check_facade_views(self.cache)

    def check_cache_invariants(self) -> None:
        if hasattr(self, "cache"):
            self.cache.check_invariants()

    def check_loaded_equals_written(self) -> None:
        if hasattr(self, "cache"):
            check_tree_bytes(self.cache.core, self.xfer.dev, self.xfer.host)

    def check_requests_read_written(self) -> None:
        if not hasattr(self, "cache"):
            return
        for rid, r in views.requests(self.cache).items():
            if r.state == "running":
                self._check_read(rid, r.tokens)

    def check_request_records(self) -> None:
        if not hasattr(self, "cache"):
            return
        ops = views.ops(self.cache.core)
        reqs = views.requests(self.cache)
        for rid, r in reqs.items():
            if r.owed_forward < 0:
                raise InvariantViolation("counts_with_receipts", f"request {rid!r}", "owes a negative count")
            for op in r.ops:
                if op not in ops:
                    raise InvariantViolation("operation_ends_once", f"request {rid!r}",
                                             f"waits on op {op}, which already ended")
            if r.state in ("finishing", "retracting") and not r.ops:
                raise InvariantViolation("release_once_after_fence", f"request {rid!r}",
                                         f"{r.state} without its own writeback in flight")
            if r.state == "aborting" and r.settled:
                raise InvariantViolation("release_once_after_fence", f"request {rid!r}",
                                         "aborting with nothing owed: never released")
            if r.state == "loading" and not r.pins:
                raise InvariantViolation("loadback_source_pinned", f"request {rid!r}", "loading without a pin")
            if r.state in TERMINAL and r.ops:
                raise InvariantViolation("release_once_after_fence", f"request {rid!r}",
                                         f"{r.state} with operations {sorted(r.ops)} still in flight")
        for rid, own in list(self.fenced.items()):
            fenced = reqs.get(rid)
            if fenced is None or fenced.state != "aborting":
                del self.fenced[rid]
                continue
            for g, pages in own.items():
                if not set(pages) <= set(fenced.own.get(g, ())):
                    raise InvariantViolation("release_once_after_fence", f"request {rid!r}",
                                             f"aborting with work in flight but its pages of {g!r} were released")
        core = self.cache.core
        held = {i for r in reqs.values() for i in r.receipts()}
        leaked = (set(views.locks(core)) | set(views.receipts(core))) - held
        if leaked:
            raise InvariantViolation("atomic_admission", "the facade",
                                     f"receipts {sorted(leaked)} are held by no request (a reservation not rolled back)")

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


register_machine("facade", FacadeMachine)
