"""Batched steps: one call per scheduler step for every request in the batch.

An engine's scheduler reports the forward results of the pass that just returned and
reserves pages for the next pass, for every request in its batch, once per step.
:class:`Batcher` does both (:meth:`Batcher.step`): first each forward result (what
:class:`~kvtier.fsm.request.forward.ForwardResults` does for one request), then each reservation
(what :meth:`~kvtier.fsm.request.admission.Admitter.reserve` does), item by item in the order
given. Every item is all or nothing on its own: an item that is refused (bad arguments,
a state that does not accept the call, pages short after eviction) changes nothing and
leaves every other item's outcome intact. The forward fence (invariant ``forward_fence``) holds item by
item: a result frees what waited on that pass, a reservation counts one pass owed.

The single-request calls (:meth:`Batcher.reserve_one`, :meth:`Batcher.result_one`) are the
same code without the per-item catching; ``kvtier.TieredCache.reserve`` and
``step_done`` wrap them.

Units: tokens; a *unit* is ``layout.alignment`` tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, NamedTuple

from .admission import Admitter
from ..checks import as_bool, as_int, as_keys
from ..errors import KvtierError, UsageError
from ..lifecycle.names import REQUEST_CALL as RC, REQUEST_STATE as RS
from .forward import ForwardResults
from ..node.node import PageMap
from .request import CALLS
from .table import RequestTable

__all__ = ["ForwardResult", "Reservation", "ItemOutcome", "StepOutcome", "Batcher", "OK", "SHORT", "REFUSED",
           "SKIPPED"]

OK = "ok"  #: the item was applied
SHORT = "short"  #: a reservation found device pages short after eviction (nothing changed)
REFUSED = "refused"  #: the item raised (``ItemOutcome.error``; nothing changed for it)
SKIPPED = "skipped"  #: not attempted: an earlier reservation was short and ``stop_on_short`` was set


_FIRST = itemgetter(0)
_PLAIN = frozenset({tuple})


class ForwardResult(NamedTuple):
    """The result of the forward pass for one request (see ``TieredCache.step_done``); a
    plain tuple ``(request_id, computed_tokens[, new_units[, checkpoint]])`` does as well.

    Attributes:
        request_id: the request.
        computed_tokens: tokens that now have KV (0: the pass was discarded).
        new_units: keys of units completed beyond the prompt's.
        checkpoint: the engine holds the exact state at ``floor(tokens/alignment)`` units.
    """

    request_id: str
    computed_tokens: int
    new_units: Sequence[Hashable] = ()
    checkpoint: bool = False


class Reservation(NamedTuple):
    """Pages for ``tokens`` more tokens of one request (its next prefill chunk or decode
    token; see ``TieredCache.reserve``); a plain tuple ``(request_id, tokens)`` does as well."""

    request_id: str
    tokens: int


@dataclass(frozen=True, slots=True)
class ItemOutcome:
    """What one item of a batched step did.

    Attributes:
        request_id: the item's request.
        status: :data:`OK`, :data:`SHORT`, :data:`REFUSED` or :data:`SKIPPED`.
        pages: for a reservation, the pages newly added to the request's table; for a
            forward result, the checkpoint pages the tree adopted (group -> page ids).
        error: the exception of a refused item (``UsageError``, ``IllegalTransition`` ...).
    """

    request_id: str
    status: str
    pages: PageMap = field(default_factory=dict)
    error: KvtierError | None = None

    @property
    def ok(self) -> bool:
        """True when the item was applied."""
        return self.status == OK


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """The outcomes of one batched step, item by item in the order given, kept compact
    (a step of a large batch builds no record per item): statuses in lists, pages and
    errors only where there are any, keyed by the item's index.

    Attributes:
        result_ids, reserve_ids: the items' request ids.
        result_status, reserve_status: each item's status (:data:`OK`, :data:`SHORT`,
            :data:`REFUSED`, :data:`SKIPPED`).
        adopted: result index -> checkpoint pages the tree adopted (non-empty only).
        new_pages: reservation index -> pages newly added to its table (non-empty only).
        errors: ``("results" | "reserve", index)`` -> the exception of a refused item.
    """

    result_ids: tuple[str, ...]
    result_status: tuple[str, ...]
    reserve_ids: tuple[str, ...]
    reserve_status: tuple[str, ...]
    adopted: dict[int, PageMap]
    new_pages: dict[int, PageMap]
    errors: dict[tuple[str, int], KvtierError]

    @property
    def ok(self) -> bool:
        """True when every item was applied."""
        return not self.errors and self.reserve_status.count(OK) == len(self.reserve_status)

    @property
    def results(self) -> tuple[ItemOutcome, ...]:
        """One :class:`ItemOutcome` per forward result."""
        return tuple(ItemOutcome(rid, st, self.adopted.get(i, {}), self.errors.get(("results", i)))
                     for i, (rid, st) in enumerate(zip(self.result_ids, self.result_status)))

    @property
    def reserved(self) -> tuple[ItemOutcome, ...]:
        """One :class:`ItemOutcome` per reservation."""
        return tuple(ItemOutcome(rid, st, self.new_pages.get(i, {}), self.errors.get(("reserve", i)))
                     for i, (rid, st) in enumerate(zip(self.reserve_ids, self.reserve_status)))

    def raise_first(self) -> None:
        """Raise the first refused item's exception, if any (results first)."""
        for key in sorted(self.errors, key=lambda k: (k[0] != "results", k[1])):
            raise self.errors[key]


class Batcher:
    """Batched and single forward results and reservations for the requests of ``table``."""

    def __init__(self, table: RequestTable, admitter: Admitter, forward: ForwardResults) -> None:
        self.table = table
        self.admitter = admitter
        self.forward = forward
        self._reserve_states = CALLS[RC.reserve]
        self._find = table.lookup
        self._running_result_noop = forward.running_result_noop
        self._align = table.align

    # -- one request -----------------------------------------------------------------
    def reserve_one(self, request_id: str, tokens: int) -> PageMap | None:
        """Reserve pages for ``tokens`` more tokens of one request: the new pages, or
        ``None`` when pages are short (nothing changed).

        Raises:
            UsageError: unknown request, a state other than ``running``/``loading``, or
                ``tokens`` < 1; nothing changes.
        """
        t = self.table
        r = t.get(request_id)
        t.require(r, RC.reserve)
        if type(tokens) is not int or tokens < 1:
            tokens = as_int(tokens, f"request {request_id!r}: reserve tokens", minimum=1)
        return self.admitter.reserve(r, tokens)

    def result_one(self, request_id: str, computed_tokens: int, new_units: Sequence[Hashable] = (),
                   checkpoint: bool = False) -> PageMap:
        """Report one request's forward result: the checkpoint pages the tree adopted.

        Raises:
            UsageError: unknown request, nothing owed, a bad argument, or more tokens than
                reserved; nothing changes.
        """
        r = self.table.get(request_id)
        if type(computed_tokens) is not int or computed_tokens < 0:
            computed_tokens = as_int(computed_tokens, f"request {request_id!r}: computed_tokens")
        if checkpoint is not True and checkpoint is not False:
            checkpoint = as_bool(checkpoint, f"request {request_id!r}: step_done checkpoint")
        if new_units != () or type(new_units) is not tuple:  # () is the hot path (most steps)
            new_units = as_keys(new_units, f"request {request_id!r}: step_done new_units")
        return self.forward.step_done(r, computed_tokens, new_units, checkpoint)

    # -- a batch ---------------------------------------------------------------------
    def step(self, results: Sequence[ForwardResult | tuple[Any, ...]],
             reserve: Sequence[Reservation | tuple[Any, ...]], stop_on_short: bool = False) -> StepOutcome:
        """Report ``results`` then make the reservations ``reserve``, item by item; see
        ``TieredCache.step``. An item on the hot path (a decode token its pages cover, a
        result that completes no unit) costs a few attribute updates; any other goes
        through :meth:`result_one` / :meth:`reserve_one`.

        Raises:
            UsageError: ``results`` or ``reserve`` is not a list of such tuples, or a
                request appears twice in one of them (nothing changes).
        """
        rids = self._ids(results, 2, 4, "results")
        qids = self._ids(reserve, 2, 2, "reserve")
        if stop_on_short is not True and stop_on_short is not False:
            stop_on_short = as_bool(stop_on_short, "step: stop_on_short")
        find = self._find
        adopted: dict[int, PageMap] = {}
        new_pages: dict[int, PageMap] = {}
        errors: dict[tuple[str, int], KvtierError] = {}
        rst: list[str] = [OK] * len(results)
        if results:
            # the hot path first, as one pass of plain counter arithmetic per item: a result
            # of a running request with a pass owed, two fields, that completes no unit and
            # leaves nothing to publish or free (ForwardResults.quick, inlined); any other
            # item goes through result_one below, in order
            slow: list[int] = []
            if self._running_result_noop:
                running = RS.running
                align = self._align
                for i, f in enumerate(results):
                    r = find(rids[i])
                    if r is not None and len(f) == 2 and r.state == running and r.passes > r.results \
                            and r.ckpt_borrow is None and not r.deferred:
                        n = f[1]
                        if type(n) is int and n >= 0:
                            t = r.tokens + n
                            if t <= r.reserved and (t if t < len(r.units) * align else len(r.units) * align) \
                                    < (r.published + 1) * align:
                                r.tokens = t
                                r.retract_ckpt = False
                                r.results += 1
                                continue
                    slow.append(i)
            else:
                slow = list(range(len(results)))
            for i in slow:
                f = results[i]
                try:
                    pages = self.result_one(f[0], f[1], f[2] if len(f) > 2 else (), f[3] if len(f) > 3 else False)
                except KvtierError as exc:
                    errors[("results", i)] = exc
                    rst[i] = REFUSED
                    continue
                if pages:
                    adopted[i] = pages
        qst: list[str] = [OK] * len(reserve)
        accepts = self._reserve_states
        for i, q in enumerate(reserve):
            r = find(qids[i])
            n = q[1]
            if r is not None and type(n) is int and n >= 1 and r.state in accepts:
                # the hot path (Admitter.covered, inlined): its pages already cover the tokens;
                # with a pass out (overlapped scheduling) the next pass starts where it ends
                reserved = r.reserved
                upto = (reserved if r.passes > r.results else r.tokens) + n
                if upto < reserved:
                    upto = reserved
                if upto <= r.room:
                    r.reserved = upto
                    r.passes += 1
                    continue
            try:
                new = self.reserve_one(q[0], n)
            except KvtierError as exc:
                errors[("reserve", i)] = exc
                qst[i] = REFUSED
                continue
            if new is None:
                qst[i] = SHORT
                if stop_on_short:
                    qst[i + 1:] = [SKIPPED] * (len(reserve) - i - 1)
                    break
                continue
            if new:
                new_pages[i] = new
        return StepOutcome(rids, tuple(rst), qids, tuple(qst), adopted, new_pages, errors)

    @staticmethod
    def _ids(items: object, least: int, most: int, what: str) -> tuple[str, ...]:
        """The request ids of ``items`` (tuples of ``least`` .. ``most`` fields, a request
        at most once): the types, lengths and ids in C-level passes (``map``), the item by
        item walk only to name what is wrong."""
        if type(items) is list or type(items) is tuple:
            try:
                types = set(map(type, items))
                if types <= _PLAIN or all(issubclass(t, tuple) for t in types):
                    lens = set(map(len, items))
                    if not lens or (min(lens) >= least and max(lens) <= most):
                        ids = tuple(map(_FIRST, items))
                        if len(set(ids)) == len(ids):
                            return ids
            except Exception:  # named below, item by item
                pass
        return _ids_checked(items, least, most, what)


def _ids_checked(items: object, least: int, most: int, what: str) -> tuple[str, ...]:
    """:meth:`Batcher._ids`, item by item (raises UsageError naming what is wrong)."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise UsageError(f"step: {what} must be a list of tuples, got {items!r}")
    try:
        ids = tuple([x[0] for x in items if isinstance(x, tuple) and least <= len(x) <= most])
    except TypeError:
        raise UsageError(f"step: {what} must hold tuples of {least}..{most} fields "
                         f"(ForwardResult / Reservation), got {items!r}") from None
    if len(ids) != len(items):
        bad = next(x for x in items if not isinstance(x, tuple) or not least <= len(x) <= most)
        raise UsageError(f"step: {what} must hold tuples of {least}..{most} fields "
                         f"(ForwardResult / Reservation), got {bad!r}")
    try:
        distinct = len(set(ids))
    except TypeError:
        raise UsageError(f"step: request ids in {what} must be str, got {ids!r}") from None
    if distinct != len(ids):
        raise UsageError(f"step: a request appears twice in {what} (one pass per step): {ids!r}")
    return ids
