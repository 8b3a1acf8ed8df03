"""Admission and reservation: a request gets its pages, all or nothing.

:class:`Admitter` matches a request's prompt in the tree, locks and pins what it reuses,
starts (or joins) the loadback of a host hit and reserves the request's own pages for the
first chunk, in one all-or-nothing step (invariant ``atomic_admission``), then fires ``schedule`` (or
``resume``). :meth:`Admitter.reserve` adds pages for one more forward pass and counts it
owed.

Units: tokens; a *unit* is ``layout.alignment`` tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ..errors import CapacityError, UsageError
from ..lifecycle.names import REQUEST_CALL as RC, REQUEST_EVENT as RE
from ..node.node import PageMap
from .request import TERMINAL, Admission, Request
from .table import MatchMode, RequestTable

__all__ = ["Admitter"]


class Admitter:
    """Admits, resumes and reserves for the requests of ``table``.

    Args:
        table: the request table (its core holds the pages).
        history_replay: allow history-only hits plus a recompute span for new requests.
    """

    def __init__(self, table: RequestTable, history_replay: bool) -> None:
        self.table = table
        self.core = table.core
        self.history_replay = history_replay
        self._own_groups = (*table.history, *table.state_pages)  # the groups a request owns pages of

    def admit(self, request_id: str, units: Sequence[Hashable], prompt_tokens: int,
              chunk_tokens: int, prev: Request | None) -> Admission | None:
        """Admit a new request (arguments checked by the facade, ``prev`` its record in the
        table or ``None``): see :meth:`kvtier.TieredCache.admit`.

        Raises:
            UsageError: the id is admitted and not ``waiting``, or too few unit keys.
        """
        t = self.table
        if prev is not None:
            t.require(prev, RC.admit, " is already admitted")
        full = prompt_tokens // t.align
        if len(units) < full:
            raise UsageError(f"request {request_id!r}: {prompt_tokens} prompt tokens need {full} unit keys, "
                             f"got {len(units)}")
        # an ended request's id may be admitted again before poll() forgets it: a new record
        if prev is not None and prev.state not in TERMINAL:
            r = prev
            r.units = list(units)
            r.prompt_tokens = prompt_tokens
        else:
            r = Request(request_id, list(units), prompt_tokens)
        t.add(r)
        # never reuse the whole prompt: the last token must be computed to get logits
        usable = (prompt_tokens - 1) // t.align
        return self._admit(r, r.units[:usable], MatchMode.PREFIX_REUSE, prompt_tokens, chunk_tokens, RE.schedule)

    def resume(self, r: Request, chunk_tokens: int) -> Admission | None:
        """Re-admit a retracted request with ``state_recovery`` (its own terminal exactly,
        or recompute from scratch); all or nothing."""
        n_units = min(r.tokens // self.table.align, len(r.units))
        # the hit covers its own terminal (or nothing); the tail up to r.tokens is recomputed
        return self._admit(r, r.units[:n_units], MatchMode.STATE_RECOVERY, r.tokens, chunk_tokens, RE.resume)

    def _admit(self, r: Request, key: Sequence[Hashable], mode: MatchMode, limit: int, chunk: int,
               event: str) -> Admission | None:
        t, core = self.table, self.core
        t.check(r, event)  # its rows differ only in has_loadback: this checks the state
        # (unit keys checked at the facade's edge: the core trusts them)
        m = core.match_trusted(key, mode, self.history_replay and mode is MatchMode.PREFIX_REUSE)
        if mode is MatchMode.STATE_RECOVERY and m.host_units != len(key):
            m = core.match_trusted((), mode, False)  # no exact terminal state: recompute from scratch
        hit_units = m.host_units
        start = hit_units * t.align - m.recompute_tokens  # (m.hit_tokens)
        hold = core.lock(m.device_node, r.request_id) if m.device_node is not core.root else None
        upto = min(max(limit, start + 1), start + chunk) if limit > start else start + chunk
        need = {g: max(0, -(-upto // t.tokens_per_page[g]) - hit_units * t.pages_per_unit[g]) for g in t.history}
        need.update(t.state_pages)
        load = None
        try:
            if hit_units > m.device_units:  # (m.needs_loadback)
                load = core.load(m, r.request_id, extra=need)
                own = load.extra
            else:
                own = core.alloc_trusted(need)
        except CapacityError:
            if hold is not None:
                core.unlock(hold)
            return None
        # commit
        table: PageMap
        if load is not None:
            if hold is not None:
                core.unlock(hold)
            r.lock = load.lock
            r.pins = [load.pin]
            table = load.device_pages
            ops = core.operations()
            for op in load.op_ids:
                t.wait(r, op)
                # a joined loadback may have completed layers on every rank already
                r.layers[op] = min(ops[op].layers.get(k, -1) for k in range(core.world_size))
        else:
            r.lock = hold
            table = core.device_pages(m.device_node)
            if t.state_pages and any(g in table for g in t.state_pages):
                # its forward pass copies the hit's checkpoint (Admission.checkpoint_pages): a
                # lock alone does not stop a deeper insert from dropping a chunk checkpoint
                t.drop_checkpoint_borrow(r)
                r.ckpt_borrow = core.borrow([m.device_node], r.request_id)
                r.ckpt_pages = {g: list(table[g]) for g in t.state_pages if g in table}
        if load is None:  # a fresh page table and fresh pages: their lists become the request's
            r.canon = {g: table[g] for g in t.history}
            r.own = {g: own.get(g) or [] for g in self._own_groups}
        else:
            r.canon = {g: list(table[g]) for g in t.history}
            r.own = {g: list(own.get(g, ())) for g in self._own_groups}
        r.published = hit_units
        t.set_room(r)
        r.tokens = start
        r.hit_tokens = start
        r.reserved = upto
        r.has_loadback = load is not None
        r.layers_failed = False
        r.passes += 1
        t.fire(r, event)
        t.counters.admitted(event, limit, start, m.device_units * t.align)
        return Admission(r.request_id, start, upto - start, start, m.device_units * t.align,
                         t.page_table(r), load.command.op_id if load is not None and load.command is not None else None,
                         load.op_ids if load is not None else (), m.recompute_tokens,
                         m.history_units * t.align,
                         {g: list(table[g]) for g in t.state_pages if g in table} if t.state_pages else {})

    @staticmethod
    def covered(r: Request, tokens: int) -> bool:
        """The hot path of :meth:`reserve` (most decode steps): when the pages ``r`` holds
        already cover ``tokens`` more tokens, count the pass owed and return True; else
        change nothing and return False."""
        # with a pass out (overlapped scheduling) the next pass starts where it ends
        upto = (r.reserved if r.passes > r.results else r.tokens) + tokens
        if upto < r.reserved:
            upto = r.reserved
        if upto > r.room:
            return False
        r.reserved = upto
        r.passes += 1
        return True

    def reserve(self, r: Request, tokens: int) -> PageMap | None:
        """Reserve device pages for ``tokens`` more tokens and count one forward pass owed;
        all or nothing (state checked by the caller).

        Returns:
            The pages newly added to its table, or ``None`` if pages are short after
            eviction (nothing changed).
        """
        if self.covered(r, tokens):
            return {}
        start = r.reserved if r.passes > r.results else r.tokens
        upto = max(r.reserved, start + tokens)
        need = self.table.need(r, upto)
        pages: PageMap = {}
        if any(need.values()):
            try:
                pages = self.core.alloc_device(need)
            except CapacityError:
                return None
            self.table.add_own(r, pages)
        r.reserved = upto
        r.passes += 1
        return pages
