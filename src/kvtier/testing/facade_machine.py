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

from kvtier.fsm.errors import DuplicateCompletion, InvariantViolation, KvtierError, LifecycleError, UnknownOperation
from kvtier.fsm.machines import request_lifecycle
from kvtier.fsm.node import HOST_VISIBLE
from kvtier.fsm.ops import Operation

from ..eventlog import attach_active
from ..tiered import TieredCache
from . import _views as views
from .base import ROLL, TERMINAL, KitMachine, kit_layout, recorded
from .canonical import CanonicalState
from .content import check_tree_bytes, content, node_prefix
from .plugs import SchedulerAdapter, TransferBackend
from .sequence import Step, register_machine

__all__ = ["FacadeMachine"]

_REQS = 3
_RARE = st.integers(0, 4)  # destructive rules act when 0: one draw in five


class FacadeMachine(KitMachine):
    """Drives a :class:`TieredCache` through a :class:`SchedulerAdapter` with a
    :class:`TransferBackend`, checking after every step the core's and the facade's
    invariants plus invariant 12 for the tree and for what running requests read.

    Requests ``r0``..``r2`` have prompts drawn from a small alphabet (shared prefixes,
    splits); their decode units are private. Subclass and override
    :meth:`make_scheduler` / :meth:`make_transfer` to test an engine's integration.
    """

    kit_invariants = ("check_cache_invariants", "check_loaded_equals_written", "check_requests_read_written",
                      "check_request_records")
    #: for ``kvtier verify``: the fixed prompts of the requests and their count
    verify_prompts: ClassVar[tuple[tuple[str, ...], ...]] = (("a", "b"), ("a", "c"))
    verify_max_units: ClassVar[int] = 3

    def __init__(self) -> None:
        super().__init__()
        self.cache: TieredCache
        self.sched: SchedulerAdapter
        self.xfer: TransferBackend
        self.units: dict[str, list[Hashable]] = {}
        self.inflight: dict[int, Operation] = {}
        self.expired: set[int] = set()  # ops their deadline settled (their bytes never move)
        self.world = 1
        self.deadline: int | None = None
        self.fenced: dict[str, dict[str, list[int]]] = {}  # aborting request -> own pages it must keep

    # -- plug points -----------------------------------------------------------------
    def make_cache(self, world: int, policy: str, dev_units: int, host_units: int, deadline: int | None,
                   wb_limit: int) -> TieredCache:
        """The cache under test (override to change the layout or options)."""
        return TieredCache(kit_layout(False), dev_units, host_units, policy=policy, world_size=world,
                           op_deadline_steps=deadline, max_writebacks_in_flight=wb_limit)

    def make_scheduler(self, cache: TieredCache) -> SchedulerAdapter:
        """The scheduler adapter (override to plug in an engine's scheduler)."""
        return SchedulerAdapter(cache)

    def make_transfer(self, world: int, num_layers: int) -> TransferBackend:
        """The transfer backend (override to plug in an engine's transfer engine)."""
        return TransferBackend(world, num_layers)

    @initialize(world=st.sampled_from([1, 2]), policy=st.sampled_from(
        ["write_through", "write_through_selective", "write_back"]), dev_units=st.integers(3, 10),
        host_units=st.integers(2, 10), deadline=st.sampled_from([None, 4]), wb_limit=st.sampled_from([1, 2]))
    @recorded
    def setup(self, world: int, policy: str, dev_units: int, host_units: int, deadline: int | None,
              wb_limit: int) -> None:
        if self.world_size is not None and not self.kit_replaying:
            world = self.world_size
        self.kit_set_args(world=world, policy=policy, dev_units=dev_units, host_units=host_units,
                          deadline=deadline, wb_limit=wb_limit)
        self.world = world
        self.deadline = deadline
        self.cache = self.make_cache(world, policy, dev_units, host_units, deadline, wb_limit)
        attach_active(self.cache)  # the event log, when one is recording (kvtier.eventlog)
        self.sched = self.make_scheduler(self.cache)
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
            self.xfer.apply(op_id, op.ok and op_id not in self.expired)
        for op_id, op in ops.items():
            self.inflight.setdefault(op_id, op)

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
        adm = self.sched.admit(rid, list(key), prompt, chunk * align)
        if adm is not None:
            self._check_read(rid, adm.device_hit_tokens)
        self._sync()

    @precondition(lambda self: any(n.state in HOST_VISIBLE for n in views.nodes(self.cache.core).values()))
    @rule(req=st.integers(0, _REQS - 1), i=st.integers(0, 100), chunk=st.integers(1, 3))
    @recorded
    def admit_cached(self, req: int, i: int, chunk: int) -> None:
        """Admit a prompt that extends the prefix of a node with a host copy (a host hit,
        so a loadback when the node was demoted)."""
        nodes = [n for _, n in sorted(views.nodes(self.cache.core).items()) if n.state in HOST_VISIBLE]
        if not nodes:
            return
        key = [str(u) for u in node_prefix(nodes[i % len(nodes)])]
        rid = self._rid(req)
        state = self._state(rid)
        r = views.requests(self.cache).get(rid)
        align = self.cache.layout.alignment
        prompt = len(key) * align + 1
        if r is not None and (state not in ("waiting", *TERMINAL) or not r.settled):
            return
        self.units[rid] = list(key)
        adm = self.sched.admit(rid, list(key), prompt, chunk * align)
        if adm is not None:
            self._check_read(rid, adm.device_hit_tokens)
        self._sync()

    @rule(req=st.integers(0, _REQS - 1), checkpoint=st.booleans(), discard=st.booleans())
    @recorded
    def step_done(self, req: int, checkpoint: bool, discard: bool) -> None:
        self._forward(self._rid(req), checkpoint, discard)

    def _forward(self, rid: str, checkpoint: bool, discard: bool) -> None:
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
            self._write_own(rid, r.tokens, r.tokens + computed)
        align = self.cache.layout.alignment
        full = (r.tokens + computed) // align
        new = [self._unit(rid, u) for u in range(len(r.units), full)] if full > len(r.units) else []
        self.sched.step_done(rid, computed, new, checkpoint)
        self._sync()

    @rule(req=st.integers(0, _REQS - 1), units=st.integers(1, 2))
    @recorded
    def reserve(self, req: int, units: int) -> None:
        rid = self._rid(req)
        state = self._state(rid)
        if state is None:
            return
        tokens = units * self.cache.layout.alignment
        if state not in ("running", "loading"):
            self._expect_refused(rid, lambda: self.sched.reserve(rid, tokens))
            return
        self.sched.reserve(rid, tokens)
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
            self._lifecycle_call(rid, r.state == "running" and r.owed_forward == 0, lambda: self.sched.finish(rid))

    @rule(req=st.integers(0, _REQS - 1), go=_RARE)
    @recorded
    def retract(self, req: int, go: int = 0) -> None:
        rid = self._rid(req)
        if go == 0 and self._state(rid) is not None:
            r = views.requests(self.cache).get(rid)
            # (refused while a forward result is owed: the forward fence, invariant 16)
            legal = r is not None and r.state == "running" and r.owed_forward == 0
            self._lifecycle_call(rid, legal, lambda: self.sched.retract(rid))

    @rule(req=st.integers(0, _REQS - 1), chunk=st.integers(1, 3))
    @recorded
    def resume(self, req: int, chunk: int) -> None:
        rid = self._rid(req)
        state = self._state(rid)
        if state is None:
            return
        align = self.cache.layout.alignment
        self._lifecycle_call(rid, state == "retracted", lambda: self.sched.resume(rid, chunk * align))

    @rule(req=st.integers(0, _REQS - 1), go=_RARE)
    @recorded
    def abort(self, req: int, go: int = 0) -> None:
        rid = self._rid(req)
        state = self._state(rid)
        if go == 0 and state is not None:
            r = views.requests(self.cache)[rid]
            own = {g: list(p) for g, p in r.own.items() if p}
            self._lifecycle_call(rid, state not in ("aborting", *TERMINAL), lambda: self.sched.abort(rid))
            if self._state(rid) == "aborting":
                self.fenced[rid] = own

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
        self.sched.complete(ev)
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
        if go != 0:
            return
        self._poll()
        while self.xfer.ready():
            op, rank = self.xfer.ready()[0]
            self.sched.complete(self.xfer.take(op, rank, True))
            self._sync()

    @rule()
    @recorded
    def poll(self) -> None:
        self._poll()

    def _poll(self) -> None:
        out = self.sched.poll()
        for cmd in out.commands:
            self.xfer.submit(cmd)
        lc = request_lifecycle()
        for ev in out.events:
            if ev.state not in lc.spec.state_names:
                raise InvariantViolation("state_matches_resources", f"request {ev.request_id!r}",
                                         f"reported in unknown state {ev.state!r}")
        self._sync()

    @rule(tier=st.sampled_from(["device", "device", "host"]), g=st.sampled_from(["kv", "c4"]),
          n=st.integers(1, 16))
    @recorded
    def pressure(self, tier: str, g: str, n: int) -> None:
        core = self.cache.core
        if tier == "device":
            core.evict_device({g: n})
        else:
            core.evict_host({g: n})
        self._sync()

    # -- invariants --------------------------------------------------------------------
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
                out.append(Step.of("admit", dict(req=req, key=list(key), chunk=len(key), tail=False)))
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
        if views.outbox(core) or views.request_events(self.cache) or views.writeback_queue(core):
            out.append(Step.of("poll", {}))
        if any(views.device_victim(core, n) and n.state == "backed" for n in views.nodes(core).values()):
            out.append(Step.of("pressure", dict(tier="device", g="kv", n=64)))  # demote everything evictable
        return out

    def kit_canonical(self) -> Hashable:
        return CanonicalState(self).value()


register_machine("facade", FacadeMachine)
