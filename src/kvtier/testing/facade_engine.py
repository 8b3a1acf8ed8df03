"""The facade machine's rules for the transfer engine and the scheduler as a whole
(:mod:`kvtier.testing.facade_machine`): completions delivered (failed per rank, late,
duplicated), deadlines, polls, memory pressure, batched reservations, the victim abort
of a capacity deadlock, and liveness.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvtier.fsm import Completion, Direction
from kvtier.fsm.request.batch import OK, REFUSED, SHORT, SKIPPED, Reservation
from kvtier.fsm.errors import DuplicateCompletion, InvariantViolation, LifecycleError, UnknownOperation, UsageError
from kvtier.fsm.node import HOST_VISIBLE

from . import _views as views
from .base import ROLL, TERMINAL, recorded
from .facade_models import check_drained
from .facade_steps import RARE, REQUESTS, FacadeSteps
from .models import ModelViolation, liveness_bound
from .pass_model import check_reserve


class FacadeTransferRules(FacadeSteps):
    """Rules of the transfer engine, the clock and the scheduler as a whole."""

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

    @rule(mask=st.integers(0, 2 ** REQUESTS - 1), settle=st.booleans())
    @recorded
    def abort_victim(self, mask: int, settle: bool) -> None:
        """The scheduler's way out of a capacity deadlock: ``abort_victim`` among the
        requests of ``mask`` that may be aborted (with ``settle``, after the forward results
        owed came back and every transfer completed). Model: it aborts the one with the
        most tokens (prompt or computed; ties to the smallest id), at once, exactly when
        nothing is in flight and no forward result is owed, and otherwise changes nothing; the
        ``aborted_by_scheduler`` counter moves by one exactly when it aborts one."""
        if settle:
            for rid, r in sorted(views.requests(self.cache).items()):
                while r.owed_forward > 0:
                    self._forward(rid, False, False)
            self._pump()
        reqs = views.requests(self.cache)
        blocked = [self._rid(i) for i in range(REQUESTS) if mask >> i & 1 and self._rid(i) in reqs
                   and reqs[self._rid(i)].state not in ("aborting", *TERMINAL)]
        busy = bool(views.ops(self.cache.core)) or any(r.owed_forward > 0 for r in reqs.values())
        want = None if busy or not blocked else min(
            blocked, key=lambda rid: (-max(reqs[rid].tokens, reqs[rid].prompt_tokens), rid))
        before = {rid: r.state for rid, r in reqs.items()}
        kept = views.fingerprint(self.cache)
        counted = self.cache.aborted_by_scheduler
        got = self.cache.abort_victim(blocked)
        after = {rid: r.state for rid, r in views.requests(self.cache).items()}
        if self.cache.aborted_by_scheduler - counted != (got is not None):
            raise ModelViolation("model_views", f"abort_victim({blocked})",
                                 f"aborted {got!r} but the scheduler-abort counter moved by "
                                 f"{self.cache.aborted_by_scheduler - counted} (an operator's metric)")
        if want is not None:
            before[want] = "aborted"
        if got != want or after != before or (want is None and views.fingerprint(self.cache) != kept):
            raise ModelViolation("model_views", f"abort_victim({blocked})",
                                 f"aborted {got!r} (states {after}); the model: {want!r} (states {before}, "
                                 f"nothing else changed when it aborts none)")
        if got is not None:
            self.ends.victims.add(got)
        self._sync()

    @rule(mask=st.integers(1, 2 ** (REQUESTS + 1) - 1), units=st.integers(0, 2), stop=st.booleans())
    @recorded
    def batch_reserve(self, mask: int, units: int, stop: bool) -> None:
        """One batched step reserving for several requests at once (bit ``REQUESTS`` of ``mask``
        adds an id the cache does not know, refused), ``units`` each (0: one token), with
        ``stop_on_short`` when ``stop``. Model: each item is all or nothing on its own
        (:func:`check_reserve` for every request); a refused item raises its own error and
        changes nothing; after a short item with ``stop`` the rest are skipped."""
        reqs = views.requests(self.cache)
        rids = [self._rid(i) for i in range(REQUESTS) if mask >> i & 1 and self._rid(i) in reqs]
        if mask >> REQUESTS & 1:
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
            if st_ == OK:
                self.passes_out[rid] = self.passes_out.get(rid, 0) + 1
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
        self._deliver(i, ok)

    def _deliver(self, i: int, ok: bool, poll: bool = True) -> None:
        """(Poll, then) deliver the ``i``-th pending completion (mod their count) with ``ok``;
        a completion of a settled op is absorbed, the same completion again refused while its
        op is in flight and absorbed once it settled."""
        if poll:
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

    @precondition(lambda self: self.deadline is not None
                  and any(n.state in HOST_VISIBLE for n in views.nodes(self.cache.core).values()))
    @rule(req=st.integers(0, REQUESTS - 1), i=st.integers(0, 100))
    @recorded
    def expire_unhanded(self, req: int, i: int) -> None:
        """A loadback whose deadline passes before any poll handed its command out: it ends
        at once (``expire [!handed_out]``: no engine ever saw it, nothing is fenced) and its
        request goes back to waiting."""
        rid = self._rid(req)
        r = views.requests(self.cache).get(rid)
        if r is not None and (r.state not in ("waiting", *TERMINAL) or not r.settled):
            return
        if self._admit_host_hit(rid, i) is None:
            return
        assert self.deadline is not None  # (the rule's precondition)
        before = set(views.ops(self.cache.core))
        self.sched.advance_step(self.deadline + 1)
        self.expired |= before - set(views.ops(self.cache.core))
        self._sync()

    @precondition(lambda self: self.deadline is not None)
    @rule(steps=st.integers(1, 3))
    @recorded
    def advance(self, steps: int) -> None:
        before = set(views.ops(self.cache.core))
        self.sched.advance_step(steps)
        self.expired |= before - set(views.ops(self.cache.core))  # only deadlines settle here
        self._sync()

    @rule(go=RARE)
    @recorded
    def drain(self, go: int = 0) -> None:
        """Poll, then deliver every pending completion successfully, oldest op first."""
        if go == 0:
            self._pump()

    @rule()
    @recorded
    def poll(self) -> None:
        self._poll()

    @rule(tier=st.sampled_from(["device", "device", "host"]), g=st.integers(0, 3), n=st.integers(1, 16))
    @recorded
    def pressure(self, tier: str, g: int | str, n: int) -> None:
        """Evict ``n`` pages of a history group (by index; a name in older sequences)."""
        core = self.cache.core
        history = views.history_groups(core)
        g = g if isinstance(g, str) else history[g % len(history)]
        if tier == "device":
            core.evict_device({g: n})
        elif core.host is not None:  # (a cache without a host tier has nothing to evict there)
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

    @precondition(lambda self: any(o.command.direction is Direction.LOADBACK
                                   for o in views.ops(self.cache.core).values()))
    @rule(i=st.integers(0, 100))
    @recorded
    def layers_progress(self, i: int) -> None:
        """A loadback's layer completions arrive on every rank, its acknowledgement later:
        every rank delivers the layer completions its transfer backend queued before the
        acknowledgement of the ``i``-th loadback in flight."""
        self._poll()
        loads = sorted(op for op, o in views.ops(self.cache.core).items() if o.command.direction is Direction.LOADBACK)
        if not loads:
            return
        op = loads[i % len(loads)]
        for rank in range(self.world):
            while (nxt := self.xfer.upcoming(op, rank)) is not None and nxt.layer is not None:
                self._complete(self.xfer.take(op, rank, True))
                self._sync()

    @rule(picks=st.lists(st.integers(0, 1000), min_size=1, max_size=6), roll=ROLL)
    @recorded
    def engine_round(self, picks: list[int], roll: int = 0) -> None:
        """The engine polls once, then several completions arrive in any order (the
        ``picks``-th pending ones), each failing with the example's fault rate."""
        self._poll()
        for k, i in enumerate(picks):
            if self.xfer.ready():
                self._deliver(i, not self.kit_fail((roll + 7919 * k) % 1000), poll=False)

    @rule(go=st.integers(0, 9))
    @recorded
    def shutdown(self, go: int = 0) -> None:
        """The engine shuts down (one draw in ten): every request that may still be aborted
        is, every forward result owed comes back (discarded), every transfer completes and
        every command and event is polled, until nothing moves. Model: nothing is then held,
        in flight or tracked (:func:`~kvtier.testing.facade_models.check_drained`), and every
        request's end was reported exactly once (the polls' checks)."""
        if go == 0:
            self._shutdown()

    def _shutdown(self) -> None:
        for rid in sorted(views.requests(self.cache)):
            if self._state(rid) not in ("aborting", *TERMINAL):
                self._abort(rid)
        core = self.cache.core
        for _ in range(liveness_bound(len(views.nodes(core))) + 2):
            for rid, r in sorted(views.requests(self.cache).items()):
                while r.owed_forward > 0:
                    self._forward(rid, False, True)
            self._pump()
            self._poll()
            owed = any(r.owed_forward for r in views.requests(self.cache).values())
            if not (self.xfer.ready() or views.ops(core) or views.outbox(core) or views.writeback_queue(core)
                    or owed):
                break
        check_drained(self.cache)
