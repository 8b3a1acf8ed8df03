"""The facade's read-only answers against what the kit sees (a reference model of the
queries an engine's scheduler loop relies on).

:func:`check_facade_views` compares, after every step of the facade machines:

- ``in_flight()``: true exactly while an operation is in flight or some request owes a
  forward result (a scheduler that drains until it is false must not stop with a pass
  out);
- ``quiescent()`` / ``outstanding()``: quiescent only with no request tracked, nothing in
  flight, no forward result owed, no receipt held; the counts it reports are the kit's;
- ``state(rid)``, ``request(rid).state`` and ``allows(rid, call)`` for every call of the
  spec's ``[request.calls]``: the record's state, and the spec's table for that state.

Failures raise :class:`~kvtier.testing.models.ModelViolation` (``model_views``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.fsm.lifecycle.spec import load_spec

from . import _views as views
from .models import ModelViolation

if TYPE_CHECKING:
    from ..tiered import TieredCache

__all__ = ["check_facade_views"]

#: call -> states that accept it, read from the spec file (not from the facade).
_CALLS: dict[str, frozenset[str]] = {c: frozenset(s) for c, s in load_spec().request.calls.items()}


def check_facade_views(cache: TieredCache) -> None:
    """Raise ``model_views`` where a read-only answer of ``cache`` disagrees with the kit."""
    core = cache.core
    reqs = views.requests(cache)
    ops = views.ops(core)
    owed = sum(max(0, r.owed_forward) for r in reqs.values())
    want = bool(ops) or owed > 0
    got = cache.in_flight()
    if got != want:
        raise ModelViolation("model_views", "in_flight()",
                             f"is {got}, but {len(ops)} operations are in flight and {owed} forward results owed")
    out = cache.outstanding()
    seen = (tuple(sorted(reqs)), owed, tuple(sorted(ops)), len(views.locks(core)))
    reported = (tuple(out.requests), out.owed_forward, tuple(out.operations), out.locks)
    if reported != seen:
        raise ModelViolation("model_views", "outstanding()",
                             f"reports (requests, owed, operations, locks) {reported}, the kit sees {seen}")
    if cache.quiescent() and (reqs or want or views.locks(core) or views.receipts(core)):
        raise ModelViolation("model_views", "quiescent()", "is true with requests, work or receipts outstanding")
    for rid, r in reqs.items():
        if cache.state(rid) != r.state or cache.request(rid).state != r.state:
            raise ModelViolation("model_views", f"request {rid!r}",
                                 f"state() {cache.state(rid)!r} / request().state {cache.request(rid).state!r}, "
                                 f"its record is {r.state!r}")
        for call, states in _CALLS.items():
            if cache.allows(rid, call) != (r.state in states):
                raise ModelViolation("model_views", f"request {rid!r} ({r.state})",
                                     f"allows({call!r}) is {r.state not in states}, the spec says {r.state in states}")
