"""The read-only half of the facade: what an engine, a dashboard or a test may ask
:class:`kvtier.tiered.TieredCache` without changing anything (requests, page tables,
which call a state accepts, what is still outstanding, invariants and counters).

:class:`RequestViews` is a base class of the facade; it reads only the facade's own parts
(the request table, the node core, the completion router) and never changes them.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from kvtier.fsm import UsageError
from kvtier.fsm.request.completions import CompletionRouter
from kvtier.fsm.node.core import CacheCore
from kvtier.fsm.request.fence import check_all
from kvtier.fsm.node import PageMap
from kvtier.fsm.request import CALLS, Outstanding, RequestView
from kvtier.fsm.request.table import RequestTable

__all__ = ["RequestViews"]


class RequestViews:
    """Read-only queries of :class:`kvtier.tiered.TieredCache` (see its docstring)."""

    core: CacheCore
    _table: RequestTable
    _router: CompletionRouter
    _victims: int

    def request(self, request_id: str) -> RequestView:
        """A summary of one request, tracked or among the last ``ended_history`` ended
        (UsageError: unknown request)."""
        return self._table.view(request_id)

    def unit_keys(self, request_id: str) -> tuple[Hashable, ...]:
        """The unit keys known for the request (its prompt's full units, then decode units)."""
        return tuple(self._table.get(request_id).units)

    def state(self, request_id: str) -> str:
        """The request's lifecycle state; for the last ``ended_history`` ended requests
        still ``finished`` or ``aborted`` after :meth:`poll` reported it (UsageError:
        unknown request)."""
        r = self._table.find(request_id) if isinstance(request_id, str) else None
        return r.state if r is not None else self._table.view(request_id).state

    def requests(self) -> list[RequestView]:
        """Every request the cache still tracks (ended ones are dropped after :meth:`poll`
        reported them; :meth:`request` and :meth:`state` still answer for recent ones)."""
        return [r.view() for r in self._table]

    def page_table(self, request_id: str) -> PageMap:
        """The device page table: history groups cover tokens ``0 .. reserved`` (canonical
        pages of published units, then its own); state groups hold its working state."""
        return self._table.page_table(self._table.get(request_id))

    def allows(self, request_id: str, call: str) -> bool:
        """Whether ``call`` (``"admit"``, ``"reserve"``, ``"step_done"``, ``"layer_ready"``) is
        accepted in the request's state, as the spec's ``[request.calls]`` declares
        (UsageError: unknown request or call)."""
        if call not in CALLS:
            raise UsageError(f"allows: call must be one of {sorted(CALLS)}, got {call!r}")
        return self._table.get(request_id).state in CALLS[call]

    @property
    def table(self) -> RequestTable:
        """The request table (read its records; change them only through this facade)."""
        return self._table

    @property
    def aborted_by_scheduler(self) -> int:
        """Requests aborted by :meth:`abort_victim` or by a failed retract writeback."""
        return self._victims + self._router.aborted_by_scheduler

    def in_flight(self) -> bool:  # any operation or forward result outstanding
        return bool(self.core.ops_in_flight()) or self._table.owes_forward()

    def outstanding(self) -> Outstanding:
        """What the cache still holds or owes: requests tracked, forward results, operations,
        commands not handed out, unreported events, receipts and device pages held outside
        the tree (:class:`Outstanding`; cost grows with what is held, never capacity)."""
        return self._table.outstanding()

    def quiescent(self) -> bool:
        """True when nothing is held or owed (:attr:`Outstanding.quiescent`): after an
        engine drained (every request ended, completions delivered, :meth:`poll` called),
        ``assert cache.quiescent(), cache.outstanding()`` checks that nothing leaked."""
        return self.outstanding().quiescent

    def check_invariants(self) -> None:
        """The core's invariants plus the requests' (:func:`kvtier.fsm.request.fence.check_all`):
        raises InvariantViolation naming the invariant and the request or node."""
        check_all(self._table)

    def stats(self) -> dict[str, Any]:
        """The core's counters, scheduler aborts, and ``"facade"``: the requests' (FacadeCounters.as_dict)."""
        s = {k: v for k, v in vars(self.core.stats).items() if k != "extra"}
        return {**s, "scheduler_aborts": self.aborted_by_scheduler, "facade": self._table.counters.as_dict()}
