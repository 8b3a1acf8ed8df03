"""The facade machine's rules for requests (:mod:`kvtier.testing.facade_machine`): admissions
(fresh, cached, joining a loadback, sharing one), a conversation's next turn, preemption,
forward results, reservations, finish, retract, resume and aborts at every point.
"""

from __future__ import annotations

from collections.abc import Hashable

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvtier.fsm import Direction
from kvtier.fsm.node import HOST_VISIBLE

from . import _views as views
from .base import TERMINAL, recorded
from .content import node_prefix
from .facade_steps import ABORT_ALWAYS, RARE, REQUESTS, FacadeSteps


class FacadeRequestRules(FacadeSteps):
    """Rules that drive requests through the scheduler adapter."""

    # -- rules -------------------------------------------------------------------------
    @rule(req=st.integers(0, REQUESTS - 1), key=st.sampled_from(["a", "ab", "abb", "aba", "ba", "abab"]).map(list),
          chunk=st.integers(1, 3), tail=st.integers(0, 3))
    @recorded
    def admit(self, req: int, key: list[str], chunk: int, tail: bool | int) -> None:
        """Admit ``req`` with the prompt ``key`` plus ``tail`` tokens of a unit not full (at
        most the alignment less one; True is one)."""
        rid = self._rid(req)
        state = self._state(rid)
        align = self.cache.layout.alignment
        prompt = len(key) * align + min(int(tail), align - 1)
        r = views.requests(self.cache).get(rid)
        if r is not None and (state not in ("waiting", *TERMINAL) or (state in TERMINAL and not r.settled)
                              or (state == "waiting" and not r.settled)):
            self._expect_refused(rid, lambda: self.sched.admit(rid, list(key), prompt, chunk * align))
            return
        self.units[rid] = list(key)
        self._admit(rid, prompt, chunk * align)

    @precondition(lambda self: any(n.state in HOST_VISIBLE for n in views.nodes(self.cache.core).values()))
    @rule(req=st.integers(0, REQUESTS - 1), i=st.integers(0, 100), chunk=st.integers(1, 3), tail=st.booleans(),
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

    @precondition(lambda self: any(n.state in HOST_VISIBLE for n in views.nodes(self.cache.core).values()))
    @rule(req=st.integers(0, REQUESTS - 1), i=st.integers(0, 100), layers=st.integers(0, 3),
          then=st.sampled_from(["nothing", "nothing", "fault", "evict", "evict_then_fault"]))
    @recorded
    def shared_loadback(self, req: int, i: int, layers: int, then: str = "nothing") -> None:
        """Two requests with the same cached prompt arrive while it is on the host only:
        the first one's loadback starts, the first rank delivers ``layers`` layer
        completions of it (the other ranks none yet), then the second request joins it.
        ``then`` builds what follows on purpose: the parent's loadback fails on every rank
        (``fault``), an eviction asks for every device page while the loaded chain hangs
        from its nodes (``evict``), or both in that order."""
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
        core = self.cache.core
        if then.startswith("evict"):
            core.evict_device({g: a.capacity for g, a in core.device.items()})
            self._sync()
        if then.endswith("fault"):
            for op in sorted(r.ops):
                if op in views.ops(core):
                    self._finish_op(op, False)

    @precondition(lambda self: any(n.state in HOST_VISIBLE for n in views.nodes(self.cache.core).values()))
    @rule(req=st.integers(0, REQUESTS - 1), i=st.integers(0, 100), key=st.sampled_from(["a", "ab", "ba"]).map(list),
          ahead=st.booleans())
    @recorded
    def publish_beside_loadback(self, req: int, i: int, key: list[str], ahead: bool = False) -> None:
        """``req`` is admitted on a host-only prefix (its loadback handed out, in flight),
        then ``req + 1`` on ``key`` plus a unit no one computed, its prompt computed in one
        pass, and the engine polls, then once more after a pass of one unit more: the tree
        writebacks the new nodes queue take the room the writebacks in flight leave (the
        loadback takes none of it; the poll's quota model checks)."""
        first, rid = self._rid(req), self._rid(req + 1)
        for x in (first, rid):
            r = views.requests(self.cache).get(x)
            if r is not None and (r.state not in ("waiting", *TERMINAL) or not r.settled):
                return
        self.fresh = getattr(self, "fresh", 0) + 1
        align = self.cache.layout.alignment
        if self._admit_host_hit(first, i) is None:  # none on the host only: make one
            if self._state(first) not in (None, "waiting", *TERMINAL):
                return
            self.units[first] = [f"{first}.host{self.fresh}"]
            self._admit(first, align + 1, 2 * align)
            if self._state(first) == "running":
                self._forward(first, False, False)
                self._lifecycle_call(first, True, lambda: self._fill_checkpoint(first, self.sched.finish(first)))
            if self._admit_host_hit(first, 0) is None:
                return
        self._poll()
        self.units[rid] = [*key, f"{rid}.new{self.fresh}"]
        self._admit(rid, len(self.units[rid]) * align + 1, (len(self.units[rid]) + 1) * align)
        for _ in range(2):  # a second pass: its writeback waits behind the first one's too
            if self._state(rid) != "running":
                break
            self._forward(rid, False, False, ahead)
            self._poll()
            if self._state(rid) == "running":
                self._reserve(rid, align)

    @precondition(lambda self: any(n.state in HOST_VISIBLE for n in views.nodes(self.cache.core).values()))
    @rule(req=st.integers(0, REQUESTS - 1), i=st.integers(0, 100))
    @recorded
    def fence_two_passes(self, req: int, i: int) -> None:
        """A request loading a host hit reserves a second pass (overlapped scheduling), then
        its loadback fails on every rank: it is ``fenced`` with two passes out, and the
        first result comes back while the other is still out (the fence holds its pages
        until the last one returns)."""
        rid = self._rid(req)
        r = views.requests(self.cache).get(rid)
        if r is not None and (r.state not in ("waiting", *TERMINAL) or not r.settled):
            return
        r = self._admit_host_hit(rid, i)
        if r is None and self._state(rid) in ("waiting", None, *TERMINAL):
            # the others' locks keep the device from demoting: abort them, settle, try again
            for other in sorted(views.requests(self.cache)):
                if other != rid and self._state(other) not in ("waiting", "aborting", *TERMINAL):
                    self._abort(other)
            self._pump()
            r2 = views.requests(self.cache).get(rid)
            if r2 is None or (r2.state in ("waiting", *TERMINAL) and r2.settled):
                r = self._admit_host_hit(rid, i)
        if r is None or self._state(rid) != "loading":
            return
        self._reserve(rid, 1)
        for op in sorted(r.ops):
            if op in views.ops(self.cache.core):
                self._finish_op(op, False)
        if self._state(rid) == "fenced":
            self._forward(rid, False, False)

    @precondition(lambda self: any(n.state == "loading" for n in views.nodes(self.cache.core).values()))
    @rule(req=st.integers(0, REQUESTS - 1), i=st.integers(0, 100), tail=st.booleans())
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

    @rule(req=st.integers(0, REQUESTS - 1), chunk=st.integers(1, 3), tail=st.booleans(), demote=st.booleans(),
          overlap=st.booleans(), load_ok=st.booleans(), wb_fail=RARE)
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

    @rule(req=st.integers(0, REQUESTS - 1), chunk=st.integers(1, 3), wb_ok=st.booleans(), abort_first=RARE)
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
        self._resume(rid, chunk * self.cache.layout.alignment)
        self._sync()

    @rule(req=st.integers(0, REQUESTS - 1), checkpoint=st.booleans(), discard=st.booleans(), ahead=st.booleans())
    @recorded
    def step_done(self, req: int, checkpoint: bool, discard: bool, ahead: bool = False) -> None:
        """The forward result of ``req``'s oldest pass out; with ``ahead`` it also names the
        key of the next unit beyond what the pass completes (a decode unit known in
        advance: it counts once its tokens are computed)."""
        self._forward(self._rid(req), checkpoint, discard, ahead)

    @rule(req=st.integers(0, REQUESTS - 1), units=st.integers(0, 2))
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

    @rule(req=st.integers(0, REQUESTS - 1))
    @recorded
    def finish(self, req: int) -> None:
        rid = self._rid(req)
        r = views.requests(self.cache).get(rid)
        if r is not None and r.state == "running" and r.owed_forward > 0:
            self._forward(rid, False, False)  # the last forward result first
        if r is not None:  # finishing is legal once no forward result is owed
            self._lifecycle_call(rid, r.state == "running" and r.owed_forward == 0,
                                 lambda: self._fill_checkpoint(rid, self.sched.finish(rid)))

    @rule(req=st.integers(0, REQUESTS - 1), go=RARE)
    @recorded
    def retract(self, req: int, go: int = 0) -> None:
        rid = self._rid(req)
        if go == 0 and self._state(rid) is not None:
            r = views.requests(self.cache).get(rid)
            # (refused while a forward result is owed: the forward fence, invariant 16)
            legal = r is not None and r.state == "running" and r.owed_forward == 0
            self._lifecycle_call(rid, legal, lambda: self._fill_checkpoint(rid, self.sched.retract(rid)))

    @rule(req=st.integers(0, REQUESTS - 1), chunk=st.integers(1, 3), demote=st.booleans())
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
        self._lifecycle_call(rid, state == "retracted", lambda: self._resume(rid, chunk * align))

    @rule(req=st.integers(0, REQUESTS - 1), go=RARE)
    @recorded
    def abort(self, req: int, go: int = 0) -> None:
        """Abort: one draw in five while running or waiting, always while the request
        waits on a transfer or a forward result (``loading``, ``fenced``, ``finishing``,
        ``retracting``) or is ``retracted``, whose aborts are the rarer paths."""
        rid = self._rid(req)
        state = self._state(rid)
        if state is not None and (go == 0 or state in ABORT_ALWAYS):
            self._abort(rid)
        elif state is None and go == 0:  # unknown, or ended and forgotten: refused by name
            self._expect_refused(rid, lambda: self.sched.abort(rid))

    @precondition(lambda self: any(n.state in HOST_VISIBLE for n in views.nodes(self.cache.core).values()))
    @rule(req=st.integers(0, REQUESTS - 1), i=st.integers(0, 100), ok=st.booleans(), overlap=st.booleans(),
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

    @precondition(lambda self: any(r.state == "running" and r.owed_forward > 0
                                   for r in views.requests(self.cache).values()))
    @rule(req=st.integers(0, REQUESTS - 1), finish=st.booleans())
    @recorded
    def finish_refused(self, req: int, finish: bool) -> None:
        """Finish (or retract) a running request with a forward pass out: refused by the
        guard ``settled``, naming the request, and changing nothing (the forward fence,
        invariant 16: the pass may still write into its pages)."""
        ids = sorted(rid for rid, r in views.requests(self.cache).items()
                     if r.state == "running" and r.owed_forward > 0)
        if not ids:
            return
        rid = ids[req % len(ids)]
        call = self.sched.finish if finish else self.sched.retract
        self._expect_refused(rid, lambda: call(rid), guards=("settled",))

    def _can_compute(self, rid: str) -> bool:
        """Whether the forward pass of ``rid`` can run: running, or loading with every layer ready."""
        r = views.requests(self.cache)[rid]
        return r.state == "running" or (r.state == "loading" and all(
            self.sched.layer_ready(rid, layer) for layer in range(self.cache.layout.num_layers)))

    @precondition(lambda self: any(r.state == "loading" and r.owed_forward > 0
                                   for r in views.requests(self.cache).values()))
    @rule(req=st.integers(0, REQUESTS - 1))
    @recorded
    def forward_loading(self, req: int) -> None:
        """The forward pass of a loading request whose every layer is ready returns before
        its loadback's acknowledgement."""
        ids = sorted(rid for rid, r in views.requests(self.cache).items()
                     if r.state == "loading" and r.owed_forward > 0 and self._can_compute(rid))
        if ids:
            self._forward(ids[req % len(ids)], False, False)

    @rule(units=st.integers(0, 2))
    @recorded
    def batch_step(self, units: int) -> None:
        """A whole scheduler step: every running or loading request with no pass out
        reserves ``units`` units (0: one token), then the oldest pass out of every request
        that can compute returns."""
        tokens = units * self.cache.layout.alignment or 1
        for rid, r in sorted(views.requests(self.cache).items()):
            if r.state in ("running", "loading") and r.owed_forward == 0:
                self._reserve(rid, tokens)
        for rid, r in sorted(views.requests(self.cache).items()):
            if r.owed_forward > 0 and views.requests(self.cache).get(rid) is r and self._can_compute(rid):
                self._forward(rid, False, False)
