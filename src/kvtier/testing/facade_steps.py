"""The facade machine's state and the steps its rules share (kvtier.testing.facade_machine).

:class:`FacadeSteps` holds what the machine tracks beside the cache (the unit keys of each
request, the operations in flight, the reference models, the poisoned writebacks) and the
steps several rules take: admit, forward, reserve, abort, poll, pump, demote, with their
checks; the rules are in :mod:`kvtier.testing.facade_rules` and
:mod:`kvtier.testing.facade_engine`, the invariant checks in :mod:`kvtier.testing.facade_checks`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from hypothesis import strategies as st

from kvtier.fsm import Completion, Direction
from kvtier.fsm.errors import InvariantViolation, KvtierError, LifecycleError
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.lifecycle.machines import request_lifecycle
from kvtier.fsm.node import HOST_VISIBLE, Node
from kvtier.fsm.node.ops import Operation

from ..tiered import TieredCache
from . import _views as views
from .base import TERMINAL, KitMachine, layout_named
from .content import content, node_prefix
from .facade_models import EndModel, check_admission, check_blocked, check_poll, held, writebacks_in_flight
from .label_bounds import abort_reason, call_abort
from .logged import LogCheck
from .models import LayerModel, ModelViolation
from .pass_model import PassModel, check_chunk_rows, check_reserve
from .plugs import SchedulerAdapter, TransferBackend

__all__ = ["FacadeSteps", "REQUESTS", "RARE", "ABORT_ALWAYS"]

#: the requests the machine drives: ``r0`` .. ``r2``
REQUESTS = 3
#: destructive rules act when it draws 0: one draw in five
RARE = st.integers(0, 4)
#: the request states an abort rule always aborts in (the rarer paths)
ABORT_ALWAYS = frozenset({"loading", "fenced", "finishing", "retracting", "retracted"})


class FacadeSteps(KitMachine):
    """The facade machine's state and shared steps (see
    :class:`~kvtier.testing.facade_machine.FacadeMachine`)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: LogCheck | None = None  # the example's recorded event log (setup's logged)
        self.aborts_made = 0  # abort calls made (each takes the next reason of label_bounds.REASONS)
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
        # the engine's own count of each request's forward passes out (reserved, no result yet)
        self.passes_out: dict[str, int] = {}
        self.ends = EndModel()  # the request ends a poll may report

    # -- helpers -----------------------------------------------------------------------
    @staticmethod
    def _rid(req: int) -> str:
        return f"r{req % REQUESTS}"

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
        """The engine fills the checkpoint pages the tree adopted with the state it holds:
        at the request's terminal, ``floor(tokens / alignment)`` of the kit's own unit keys
        (not the units the cache says it published: a checkpoint adopted at another
        position then holds bytes naming another prefix, which the content model sees)."""
        if not adopted:
            return
        r = views.requests(self.cache)[rid]
        prefix = tuple(self._unit(rid, k) for k in range(r.tokens // self.cache.layout.alignment))
        ppu = self._ppu()
        for g, pages in adopted.items():
            for j, p in enumerate(pages):
                self.xfer.dev[(g, p)] = content(prefix, g, j, ppu)

    def _expect_refused(self, rid: str, call: Callable[[], Any], guards: tuple[str, ...] | None = None) -> None:
        """``call`` (on request ``rid``) must be refused with an error naming the request
        (by ``guards``, when given) and change nothing (:func:`~kvtier.testing._views.fingerprint`)."""
        before, kept = self._state(rid), views.fingerprint(self.cache)
        try:
            call()
        except (LifecycleError, KvtierError) as exc:
            if self._state(rid) != before:
                raise InvariantViolation("state_matches_resources", f"request {rid!r}",
                                         f"a refused call moved it from {before} to {self._state(rid)}") from None
            if views.fingerprint(self.cache) != kept:
                raise ModelViolation("model_refusal", f"request {rid!r} ({before})",
                                     f"a refused call changed the cache: {exc}") from None
            if repr(rid) not in str(exc) or (guards is not None and getattr(exc, "guards", None) != guards):
                raise ModelViolation("model_refusal", f"request {rid!r} ({before})",
                                     f"refused with {type(exc).__name__}: {exc}; expected an error naming the "
                                     f"request{'' if guards is None else f' and the guards {guards}'}") from None
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

    def _admit(self, rid: str, prompt: int, chunk_tokens: int) -> None:
        before = held(self.cache)
        self.ends.admitted(rid, self._state(rid))
        adm = self.sched.admit(rid, list(self.units[rid]), prompt, chunk_tokens)
        if adm is not None:
            if adm.hit_tokens >= prompt:
                raise ModelViolation("model_whole_prompt", f"request {rid!r}",
                                     f"admission reuses {adm.hit_tokens} of its {prompt} prompt tokens: "
                                     f"the last token must be computed")
            self._admitted(rid, adm)
            self._check_read(rid, adm.device_hit_tokens)
        else:
            self.passes_out[rid] = 0
            check_blocked(self.cache, rid, before)
        self._sync()

    def _admitted(self, rid: str, adm: Any) -> None:
        """An admission or a resume of ``rid`` was accepted: its first pass is out; the
        layer model and the admission model follow it."""
        self.passes_out[rid] = 1
        self.layer_model.admitted(rid, adm.wait_ops)
        check_admission(self.cache, rid, adm, self.units[rid], self.xfer.dev)

    def _resume(self, rid: str, chunk_tokens: int) -> None:
        """``resume``; one that finds no room leaves the request retracted and every page
        and receipt where it was (``atomic_admission``)."""
        before = held(self.cache)
        adm = self.sched.resume(rid, chunk_tokens)
        if adm is not None:
            self._admitted(rid, adm)
        elif self._state(rid) != "retracted" or held(self.cache) != before:
            raise InvariantViolation("atomic_admission", f"request {rid!r}",
                                     f"a blocked resume left it {self._state(rid)}, pages and receipts held "
                                     f"{before} -> {held(self.cache)}")

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

    def _finish_op(self, op: int, ok: bool) -> None:
        """Poll, then deliver every pending completion of ``op`` on every rank with ``ok``."""
        self._poll()
        while True:
            ready = [(o, rank) for o, rank in self.xfer.ready() if o == op]
            if not ready:
                return
            self._complete(self.xfer.take(op, ready[0][1], ok))
            self._sync()

    def _forward(self, rid: str, checkpoint: bool, discard: bool, ahead: bool = False) -> None:
        r = views.requests(self.cache).get(rid)
        if r is None or r.owed_forward <= 0:
            if r is not None:
                self._expect_refused(rid, lambda: self.sched.step_done(rid, 0, (), False))
            return
        if r.owed_forward != self.passes_out.get(rid, 0):
            raise ModelViolation("model_passes", f"request {rid!r} ({r.state})",
                                 f"owes {r.owed_forward} forward results; the engine has "
                                 f"{self.passes_out.get(rid, 0)} passes out")
        tokens, state = r.tokens, r.state
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
        self.passes_out[rid] -= 1
        after = views.requests(self.cache).get(rid)
        live = ("running", "loading")
        if after is not None and state in live and after.state in live and after.tokens != tokens + computed:
            raise ModelViolation("model_passes", f"request {rid!r} ({after.state})",
                                 f"has {after.tokens} tokens after a result of {computed} computed on {tokens}")
        self._sync()

    def _reserve(self, rid: str, tokens: int) -> None:
        """``reserve``, checked against :func:`~kvtier.testing.pass_model.check_reserve`."""
        r = views.requests(self.cache)[rid]
        before = (r.reserved, r.tokens, r.passes, r.results)
        got = self.sched.reserve(rid, tokens)
        check_reserve(self.cache, rid, before, got is not None, tokens)
        if got is not None:
            self.passes_out[rid] = self.passes_out.get(rid, 0) + 1
        self._sync()

    def _lifecycle_call(self, rid: str, legal: bool, call: Callable[[], Any]) -> None:
        if legal:
            call()
        else:
            self._expect_refused(rid, call)
        self._sync()

    def _abort(self, rid: str) -> None:
        """``abort(rid)``, legal or refused as its state says, with the bookkeeping of the
        models (its own writebacks poisoned, the pages it must keep while aborting)."""
        state = self._state(rid)
        if state is not None:
            r = views.requests(self.cache)[rid]
            own = {g: list(p) for g, p in r.own.items() if p}
            ops = views.ops(self.cache.core)
            mine = {op: ops[op] for op in r.ops if op in ops and ops[op].command.direction is Direction.WRITEBACK}
            reason = abort_reason(self.aborts_made)  # past the metrics' label bound (label_bounds)
            self.aborts_made += 1
            self._lifecycle_call(rid, state not in ("aborting", *TERMINAL),
                                 lambda: call_abort(self.sched, rid, reason))
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

    def _poll(self) -> None:
        before = set(views.requests(self.cache))
        keep = views.ended_history(self.cache)
        self.remembered = [rid for rid in self.remembered if rid not in before]  # admitted again: live
        writing = writebacks_in_flight(self.cache)
        out = self.sched.poll()
        for rid in sorted(before - set(views.requests(self.cache))):  # forgotten by this poll, in id order
            self.forgotten.add(rid)
            self.remembered.append(rid)
            if len(self.remembered) > keep:
                del self.remembered[0]
        for cmd in out.commands:
            self.xfer.submit(cmd)
        check_poll(self.cache, out, self.ends, writing)
        lc = request_lifecycle()
        for ev in out.events:
            if ev.state not in lc.spec.state_names:
                raise InvariantViolation("state_matches_resources", f"request {ev.request_id!r}",
                                         f"reported in unknown state {ev.state!r}")
        self._sync()
