"""The request table: every request record, the plumbing of its lifecycle, and its pages.

:class:`RequestTable` holds the :class:`~kvtier.fsm.request.Request` records by id, the
operations each waits on, the request events not yet polled, and the page accounting
every request operation shares: its page table, its own pages, the frees that wait for an
earlier forward pass (invariant ``forward_fence``) and the release of everything it
holds, exactly once (invariant ``release_once_after_fence``). It changes a request's state only through the spec's
request machine (:meth:`fire`), which refuses an illegal event and changes nothing.

This module is the one place that names the node core (the radix tree with its pools and
operations); the request operations use only its public methods.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence

from ..node.core import CacheCore
from .counters import FacadeCounters
from ..node.match import MatchMode, MatchResult
from ..node.writeback import WritePolicy
from ..errors import ConfigError, GuardRejected, UsageError
from ..layout import CacheLayout
from ..lifecycle.machines import Lifecycle, request_lifecycle
from ..lifecycle.names import REQUEST_EVENT as RE, REQUEST_STATE as RS
from ..node.node import PageMap
from ..checks import as_int
from .request import CALLS, TERMINAL, Outstanding, Request, RequestEvent, RequestView

__all__ = ["CacheCore", "MatchMode", "MatchResult", "WritePolicy", "RequestTable", "DEFAULT_ENDED_HISTORY"]

#: How many ended requests :meth:`RequestTable.view` still answers for after ``poll``
#: reported their end and the table forgot their records (a bounded history: a few
#: hundred bytes each, the oldest dropped first).
DEFAULT_ENDED_HISTORY = 1024

_STR = frozenset({str})


class RequestTable:
    """Request records by id, with the lifecycle plumbing and page accounting they share.

    Args:
        core: the node core whose pages and receipts the requests hold.
        ended_history: how many ended requests, once forgotten, :meth:`view` still
            answers for (0: none).

    Raises:
        ConfigError: ``ended_history`` not an int >= 0.
    """

    def __init__(self, core: CacheCore, ended_history: int = DEFAULT_ENDED_HISTORY) -> None:
        self.core = core
        self.ended_history = as_int(ended_history, "ended_history", error=ConfigError)
        #: the most recently forgotten ended requests, oldest first: their records (no call
        #: reaches a forgotten record, so it stays as it ended), summarised when asked
        self._history: OrderedDict[str, Request] = OrderedDict()
        layout: CacheLayout = core.layout
        self.layout = layout
        self.lifecycle: Lifecycle = request_lifecycle()
        spec = self.lifecycle.spec
        #: states that own nothing (no resources in the spec): entering one releases everything
        self.owns_nothing = frozenset(s.name for s in spec.states if not s.resources)
        self.initial = spec.initial
        self.align = layout.alignment
        self.history = [g.name for g in layout.history_groups]
        self.tokens_per_page = {g.name: g.tokens_per_page for g in layout.history_groups}
        self.pages_per_unit = {g.name: layout.pages_per_unit(g) for g in layout.history_groups}
        self.state_pages = {g.name: g.state_pages for g in layout.state_groups}
        self._records: dict[str, Request] = {}
        #: ``lookup(request_id)``: the record or ``None`` (the dict's own ``get``, for the
        #: batched steps' per-item lookups)
        self.lookup = self._records.get
        self._waiters: dict[int, set[str]] = {}  # op id -> requests waiting on it
        self._events: list[RequestEvent] = []
        self._ended: set[str] = set()  # ended requests not yet reported by poll()
        #: operator counters (kvtier.metrics): retractions and aborts counted by fire()
        self.counters = FacadeCounters()

    # ------------------------------------------------------------------ lookups
    def get(self, request_id: object) -> Request:
        """The record of ``request_id``.

        Raises:
            UsageError: no such request.
        """
        r = self._records.get(request_id) if isinstance(request_id, str) else None
        if r is None:
            ended = self._history.get(request_id) if isinstance(request_id, str) else None
            if ended is not None:
                raise UsageError(f"request {request_id!r} has ended ({ended.state}) and poll() reported it")
            raise UsageError(f"unknown request {request_id!r}")
        return r

    def states(self, request_ids: Sequence[object]) -> list[str]:
        """The lifecycle state of each of ``request_ids``, in order (one C-level lookup per
        id; the checked walk of :meth:`get` only to name what is wrong).

        Raises:
            UsageError: an unknown or ended-and-forgotten request.
        """
        get = self._records.get
        try:
            if set(map(type, request_ids)) <= _STR:
                return [get(rid).state for rid in request_ids]  # type: ignore[call-overload]
        except Exception:  # an unknown id (None has no state), or not an iterable
            pass
        return [self.get(rid).state for rid in request_ids]

    def view(self, request_id: object) -> RequestView:
        """A summary of ``request_id``: tracked, or among the last ``ended_history`` ended
        requests that ``poll`` reported and the table forgot.

        Raises:
            UsageError: neither.
        """
        r = self._records.get(request_id) if isinstance(request_id, str) else None
        if r is not None:
            return r.view()
        ended = self._history.get(request_id) if isinstance(request_id, str) else None
        if ended is None:
            raise UsageError(f"unknown request {request_id!r} (the last {self.ended_history} ended "
                             f"requests are remembered)")
        return ended.view()

    def ended(self) -> tuple[RequestView, ...]:
        """Summaries of the ended requests forgotten most recently, oldest first (at most
        ``ended_history``)."""
        return tuple(r.view() for r in self._history.values())

    def outstanding(self) -> Outstanding:
        """What the requests and the core still hold or owe (see :class:`Outstanding`)."""
        core = self.core
        kinds = [rc.kind for rc in core.receipts.node_receipts() if rc.receipt_id > 0]
        return Outstanding(tuple(sorted(self._records)), sum(r.owed_forward for r in self._records.values()),
                           tuple(sorted(op.op_id for op in core.optable)),
                           tuple(sorted(c.op_id for c in core.pending_commands())), len(self._events),
                           len(core.receipts.locks()), kinds.count("pin"), kinds.count("borrow"),
                           core.ledger.caller_count(), len(core.writebacks),
                           tuple(op.op_id for op in core.optable.fenced()),
                           sum(len(p) for _, nodes in core.fetches.items() for n in nodes for p in n.pending.values()))

    def find(self, request_id: str) -> Request | None:
        """The record of ``request_id``, or ``None``."""
        return self._records.get(request_id)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._records.values())

    def owes_forward(self) -> bool:
        """True while some request owes a forward result."""
        return any(r.passes != r.results for r in self._records.values())

    def __len__(self) -> int:
        return len(self._records)

    def add(self, r: Request) -> None:
        """Track ``r`` (replacing an ended record of the same id)."""
        self._records[r.request_id] = r
        self._ended.discard(r.request_id)
        self._history.pop(r.request_id, None)

    def waiters(self, op_id: int) -> frozenset[str]:
        """Requests waiting on operation ``op_id``."""
        return frozenset(self._waiters.get(op_id, ()))

    def pending_events(self) -> tuple[RequestEvent, ...]:
        """Request events not yet handed out by :meth:`take_events` (a copy)."""
        return tuple(self._events)

    # ------------------------------------------------------------------ checks
    def require(self, r: Request, call: str, why: str = "") -> None:
        """Refuse ``call`` unless the spec's ``[request.calls]`` accepts it in ``r``'s state.

        Raises:
            UsageError: naming the request (then ``why``), its state, the call and the accepted states.
        """
        if r.state not in CALLS[call]:
            raise UsageError(f"request {r.request_id!r}{why}: {call} in state {r.state!r} "
                             f"(accepted in {', '.join(sorted(CALLS[call]))})")

    def check(self, r: Request, event: str) -> str:
        """:meth:`Lifecycle.check`, except that a guard false in every candidate row (such as
        ``settled`` on ``retract``) is named alone.

        Raises:
            IllegalTransition, GuardRejected: nothing changes.
        """
        lc = self.lifecycle
        try:
            return lc.check(r, event)
        except GuardRejected as exc:
            rows = lc.spec.candidates(r.state, event)
            common = tuple(g.label for g in rows[0].guards
                           if all(g in t.guards for t in rows) and not lc.guard_value(g, r))
            if common and common != exc.guards:
                raise GuardRejected(exc.lifecycle, exc.subject, exc.state, exc.event, common) from None
            raise

    # ------------------------------------------------------------------ the machine
    def fire(self, r: Request, event: str) -> str:
        """Trigger ``event`` on ``r`` (refused with no change if illegal); a new state is
        reported to :meth:`take_events` (and counted in :attr:`counters`), and entering a
        state that owns nothing releases everything ``r`` holds, once.

        Returns:
            ``r``'s new state.
        """
        before = r.state
        state = self.lifecycle.fire(r, event)
        if state != before:
            aborted = state == RS.aborted
            self._events.append(RequestEvent(r.request_id, state, r.reason if aborted else None))
            if aborted or event == RE.retract:  # (the counters count only these)
                self.counters.transition(event, state, r.reason)
            if state in self.owns_nothing:
                self.release(r)
            if state == self.initial:  # sent back: it recomputes from the start of its admission
                r.tokens = r.reserved = r.published = r.hit_tokens = 0
                r.layers_failed = False
            if state in TERMINAL:
                self._ended.add(r.request_id)
        return state

    def has_news(self) -> bool:
        """Whether :meth:`take_events` has anything to do: an event to report or an ended
        request to forget."""
        return bool(self._events or self._ended)

    def take_events(self) -> list[RequestEvent]:
        """Request events since the last call, in order; ended requests (all settled) are
        forgotten once reported."""
        out = self._events
        self._events = []
        ended = self._ended
        if not ended:
            return out
        for rid in sorted(ended) if len(ended) > 1 else tuple(ended):
            r = self._records[rid]
            if r.settled:
                del self._records[rid]
                self._ended.discard(rid)
                if self.ended_history:
                    self._history[rid] = r
                    if len(self._history) > self.ended_history:
                        self._history.popitem(last=False)
        return out

    # ------------------------------------------------------------------ operations waited on
    def wait(self, r: Request, op_id: int) -> None:
        """``r`` waits on operation ``op_id`` (its loadback, a joined one, its own writeback)."""
        r.ops.add(op_id)
        self._waiters.setdefault(op_id, set()).add(r.request_id)

    def stop_waiting(self, r: Request) -> None:
        """``r`` no longer waits on any operation (they go on; their settling finds no waiter)."""
        for op in r.ops:
            self._waiters.get(op, set()).discard(r.request_id)
        r.ops.clear()
        r.layers.clear()

    def settled_waiters(self, op_id: int) -> list[Request]:
        """The requests still waiting on ``op_id``, which just settled (forgets the op)."""
        out = []
        for rid in sorted(self._waiters.pop(op_id, set())):
            r = self._records.get(rid)
            if r is not None and op_id in r.ops:
                r.ops.discard(op_id)
                r.layers.pop(op_id, None)
                out.append(r)
        return out

    # ------------------------------------------------------------------ pages
    def page_table(self, r: Request) -> PageMap:
        """History groups: canonical pages, then its own; state groups: its working state."""
        out = {g: [*r.canon.get(g, ()), *r.own.get(g, ())] for g in self.history}
        for g in self.state_pages:
            out[g] = list(r.own.get(g, ()))
        return out

    def need(self, r: Request, upto: int) -> dict[str, int]:
        """Own history pages to add so its table covers ``upto`` tokens."""
        return {g: max(0, -(-upto // self.tokens_per_page[g])  # (ints: exact, any size)
                       - len(r.canon.get(g, ())) - len(r.own.get(g, ()))) for g in self.history}

    def add_own(self, r: Request, pages: Mapping[str, list[int]]) -> None:
        """Append ``pages`` to ``r``'s own pages."""
        for g, p in pages.items():
            r.own.setdefault(g, []).extend(p)
        self.set_room(r)

    def set_room(self, r: Request) -> None:
        """Recompute the tokens the history pages of ``r``'s table cover."""
        room: int | None = None
        for g in self.history:
            covers = (len(r.canon.get(g, ())) + len(r.own.get(g, ()))) * self.tokens_per_page[g]
            if room is None or covers < room:
                room = covers
        r.room = 0 if room is None else room

    def free_later(self, r: Request, pages: Mapping[str, Sequence[int]]) -> None:
        """Free caller pages that left ``r``'s table once every pass reserved so far has
        returned: at once when none is out (invariant ``forward_fence``)."""
        mine = {g: list(p) for g, p in pages.items() if p}
        if not mine:
            return
        if r.passes == r.results:
            self.core.free_device(mine)
        else:
            r.deferred.append((r.passes, mine))

    def retire_deferred(self, r: Request) -> None:
        """Free the deferred pages whose passes have all returned."""
        while r.deferred and r.deferred[0][0] <= r.results:
            self.core.free_device(r.deferred.popleft()[1])

    def free_own(self, r: Request) -> None:
        """Free every own page of ``r`` now."""
        own = r.own
        mine = {g: p for g, p in own.items() if p}
        if mine:
            self.core.free_device(mine)
        r.own = {g: [] for g in own}
        r.room = 0

    def drop_checkpoint_borrow(self, r: Request) -> None:
        """Let go of the hit's checkpoint (the pass that copied it has returned)."""
        if r.ckpt_borrow is not None:
            self.core.release(r.ckpt_borrow)
            r.ckpt_borrow = None
            r.ckpt_pages = {}

    def unlock(self, r: Request) -> None:
        """Release ``r``'s lock on the tree (and forget the canonical pages it held)."""
        if r.lock is not None:
            self.core.unlock(r.lock)
            r.lock = None
        r.canon = {}

    def release(self, r: Request) -> None:
        """Give back everything ``r`` holds, exactly once (invariant ``release_once_after_fence``)."""
        self.unlock(r)
        if r.pins:
            for pin in r.pins:
                self.core.release(pin)
            r.pins = []
        if r.ckpt_borrow is not None:
            self.drop_checkpoint_borrow(r)
        while r.deferred:
            self.core.free_device(r.deferred.popleft()[1])
        self.free_own(r)
        if r.ops:
            self.stop_waiting(r)
        else:
            r.layers.clear()
