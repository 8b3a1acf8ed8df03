"""Batched steps: one call per scheduler step for every request in the batch.

An engine's scheduler reports the forward results of the pass that just returned and
reserves pages for the next pass, for every request in its batch, once per step.
:class:`Batcher` does both (:meth:`Batcher.step`): first each forward result (what
:class:`~kvtier.fsm.forward.ForwardResults` does for one request), then each reservation
(what :meth:`~kvtier.fsm.admission.Admitter.reserve` does), item by item in the order
given. Every item is all or nothing on its own: an item that is refused (bad arguments,
a state that does not accept the call, pages short after eviction) changes nothing and
leaves every other item's outcome intact. The forward fence (invariant 16) holds item by
item: a result frees what waited on that pass, a reservation counts one pass owed.

The single-request calls (:meth:`Batcher.reserve_one`, :meth:`Batcher.result_one`) are the
same code without the per-item catching; ``kvtier.TieredCache.reserve`` and
``step_done`` wrap them.

Units: tokens; a *unit* is ``layout.alignment`` tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from .admission import Admitter
from .checks import as_bool, as_int, as_keys
from .errors import KvtierError, UsageError
from .forward import ForwardResults
from .node import PageMap
from .request_table import RequestTable

__all__ = ["ForwardResult", "Reservation", "ItemOutcome", "StepOutcome", "Batcher", "OK", "SHORT", "REFUSED",
           "SKIPPED"]

OK = "ok"  #: the item was applied
SHORT = "short"  #: a reservation found device pages short after eviction (nothing changed)
REFUSED = "refused"  #: the item raised (``ItemOutcome.error``; nothing changed for it)
SKIPPED = "skipped"  #: not attempted: an earlier reservation was short and ``stop_on_short`` was set


@dataclass(frozen=True, slots=True)
class ForwardResult:
    """The result of the forward pass for one request (see ``TieredCache.step_done``).

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


@dataclass(frozen=True, slots=True)
class Reservation:
    """Pages for ``tokens`` more tokens of one request (its next prefill chunk or decode
    token; see ``TieredCache.reserve``)."""

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
    """The outcomes of one batched step, item by item in the order given.

    Attributes:
        results: one per forward result.
        reserved: one per reservation.
    """

    results: tuple[ItemOutcome, ...]
    reserved: tuple[ItemOutcome, ...]

    @property
    def ok(self) -> bool:
        """True when every item was applied."""
        return all(o.status == OK for o in self.results) and all(o.status == OK for o in self.reserved)


_NO_PAGES: PageMap = {}


class Batcher:
    """Batched and single forward results and reservations for the requests of ``table``."""

    def __init__(self, table: RequestTable, admitter: Admitter, forward: ForwardResults) -> None:
        self.table = table
        self.admitter = admitter
        self.forward = forward

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
        t.require(r, "reserve")
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
    def step(self, results: Sequence[ForwardResult], reserve: Sequence[Reservation],
             stop_on_short: bool = False) -> StepOutcome:
        """Report ``results`` then make the reservations ``reserve``, item by item; see
        ``TieredCache.step``.

        Raises:
            UsageError: ``results`` or ``reserve`` is not a list of the right records, or a
                request appears twice in one of them (nothing changes).
        """
        results = self._items(results, ForwardResult, "results")
        reserve = self._items(reserve, Reservation, "reserve")
        stop_on_short = as_bool(stop_on_short, "step: stop_on_short")
        done: list[ItemOutcome] = []
        for f in results:
            try:
                pages = self.result_one(f.request_id, f.computed_tokens, f.new_units, f.checkpoint)
            except KvtierError as exc:
                done.append(ItemOutcome(f.request_id, REFUSED, {}, exc))
                continue
            done.append(ItemOutcome(f.request_id, OK, pages))
        got: list[ItemOutcome] = []
        short = False
        for q in reserve:
            if short:
                got.append(ItemOutcome(q.request_id, SKIPPED))
                continue
            try:
                new = self.reserve_one(q.request_id, q.tokens)
            except KvtierError as exc:
                got.append(ItemOutcome(q.request_id, REFUSED, {}, exc))
                continue
            if new is None:
                got.append(ItemOutcome(q.request_id, SHORT))
                short = stop_on_short
            else:
                got.append(ItemOutcome(q.request_id, OK, new))
        return StepOutcome(tuple(done), tuple(got))

    @staticmethod
    def _items(items: object, kind: type, what: str) -> Sequence[object]:
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise UsageError(f"step: {what} must be a list of {kind.__name__}, got {items!r}")
        seen: set[str] = set()
        for x in items:
            if not isinstance(x, kind):
                raise UsageError(f"step: {what} must hold {kind.__name__} records, got {x!r}")
            rid = x.request_id  # type: ignore[attr-defined]
            if rid in seen:
                raise UsageError(f"step: request {rid!r} appears twice in {what} (one pass per step)")
            seen.add(rid)
        return items
