"""The request-side invariants, checked after every fuzz step.

:func:`check_requests` verifies, for every request of a :class:`RequestTable`:

- ``conservation``: its own and deferred pages are caller pages of the core, no page is
  held by two requests, and every caller page of the core is held by some request;
- ``release_once_after_fence``: ended, waiting and retracted requests hold nothing;
- ``forward_fence``: ended, waiting and retracted requests owe nothing;
  a request that owes a forward result or has an operation in flight still holds every
  page of its page table: canonical pages under its live lock (a prefix of the locked
  path's device pages), its own pages and deferred frees (caller pages, not free), and
  the checkpoint it borrowed (still the borrowed node's); a ``fenced`` request reports
  no layer readable.
"""

from __future__ import annotations

from ..errors import InvariantViolation, KvtierError
from ..lifecycle.names import REQUEST_STATE as RS
from .request import TERMINAL, Request
from .table import RequestTable

__all__ = ["check_all", "check_requests"]


def check_all(table: RequestTable) -> None:
    """The node core's invariants, then the requests' (:func:`check_requests`), counted in
    ``table.counters`` (``invariant_checks``, and ``invariant_failures`` for a raise).

    Raises:
        InvariantViolation: naming the first invariant broken and the node or request.
    """
    table.counters.invariant_checks += 1
    try:
        table.core.check_invariants()
        check_requests(table)
    except KvtierError:
        table.counters.invariant_failures += 1
        raise


def check_requests(table: RequestTable) -> None:
    """Raise :class:`InvariantViolation` naming the first invariant a request breaks."""
    core = table.core
    external = {g.name: core.external_pages(g.name) for g in table.layout.groups}
    seen: dict[tuple[str, int], str] = {}
    for r in table:
        who = f"request {r.request_id!r}"
        held = [(g, p) for g, pages in r.own.items() for p in pages]
        held += [(g, p) for g, pages in r.deferred_pages().items() for p in pages]
        for g, p in held:
            if p not in external[g]:
                raise InvariantViolation("conservation", who, f"page {p} of {g!r} is not held by a caller")
            if (g, p) in seen:
                raise InvariantViolation("conservation", who, f"page {p} of {g!r} also held by {seen[(g, p)]!r}")
            seen[(g, p)] = r.request_id
        owns_nothing = r.state in table.owns_nothing
        if owns_nothing and (r.lock is not None or r.pins or r.ckpt_borrow is not None or held):
            raise InvariantViolation("release_once_after_fence", who,
                                     f"{r.state} but still holds pages, locks, pins or borrows")
        if owns_nothing and not r.settled:
            raise InvariantViolation("forward_fence", who,
                                     f"{r.state} but owes {r.owed_forward} forward result(s) and ops {sorted(r.ops)}")
        if not r.settled:
            _check_fenced(table, r, who)
    if sum(len(p) for p in external.values()) != len(seen):
        raise InvariantViolation("conservation", "the request table",
                                 f"{sum(len(p) for p in external.values())} caller pages in the core, "
                                 f"{len(seen)} held by requests")


def _check_fenced(table: RequestTable, r: Request, who: str) -> None:
    """Invariant ``forward_fence`` for one request that owes a forward result or waits on an operation."""
    core = table.core
    if r.state in TERMINAL:
        raise InvariantViolation("forward_fence", who, f"{r.state} but still owes items")
    if any(r.canon.get(g) for g in table.history):
        if r.lock is None or r.lock.released:
            raise InvariantViolation("forward_fence", who, "reads canonical pages without a live lock")
        path = core.device_pages(r.lock.node)
        for g, pages in r.canon.items():
            if path.get(g, [])[:len(pages)] != pages:
                raise InvariantViolation("forward_fence", who,
                                         f"canonical pages of {g!r} are no longer its locked path's device pages")
    if r.ckpt_pages:
        borrow = r.ckpt_borrow
        if borrow is None or borrow.released:
            raise InvariantViolation("forward_fence", who, "copies a checkpoint it no longer borrows")
        there = core.device_pages(borrow.nodes[-1])
        if any(there.get(g) != p for g, p in r.ckpt_pages.items()):
            raise InvariantViolation("forward_fence", who, "the checkpoint it copies left the borrowed node")
    if r.state == RS.fenced and not r.layers_failed:
        raise InvariantViolation("forward_fence", who, "fenced after a failed loadback, but layers read as ready")
