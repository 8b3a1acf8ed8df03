"""Forward results and publishing: computed units join the tree.

:class:`ForwardResults` takes a forward pass's result (:meth:`ForwardResults.step_done`): it counts
the pass returned, frees the pages whose free waited for it (invariant ``forward_fence``), and for a
running request inserts its newly full units (and, when asked, the continuation-state
checkpoint at the last full unit) into the tree, moving the request's lock to the new
terminal. Pages that leave the request's table at a publish (its copies of canonical
pages, checkpoint pages the tree did not adopt) are freed only once every pass reserved
before them has returned: with overlapped scheduling the next pass is already out and
may read them.

Units: tokens; a *unit* is ``layout.alignment`` tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ..errors import CapacityError, UsageError
from ..lifecycle.names import REQUEST_CALL as RC, REQUEST_EVENT as RE, REQUEST_STATE as RS
from ..node.node import PageMap
from .request import CALLS, Request
from .table import RequestTable

__all__ = ["ForwardResults"]


class ForwardResults:
    """Forward results and publishing for the requests of ``table``."""

    def __init__(self, table: RequestTable) -> None:
        self.table = table
        self.core = table.core
        #: the spec's ``forward_result`` in ``running`` is an unguarded internal transition
        self.running_result_noop = table.lifecycle.is_noop(RS.running, RE.forward_result)
        self._align = table.align
        self._step_done_states = CALLS[RC.step_done]

    def step_done(self, r: Request, computed_tokens: int, new_units: Sequence[Hashable],
                  checkpoint: bool) -> PageMap:
        """The forward pass that included ``r`` returned (arguments checked by the facade):
        see :meth:`kvtier.TieredCache.step_done`.

        Raises:
            UsageError: not accepted in its state, no forward result owed, or more tokens
                than reserved; nothing changes.
        """
        t = self.table
        if r.state not in self._step_done_states:
            t.require(r, RC.step_done)  # raises, naming the accepted states
        if r.passes == r.results:
            raise UsageError(f"request {r.request_id!r} (state {r.state!r}) owes no forward result")
        computing = r.state in (RS.running, RS.loading)
        # a discarded result (fenced, aborting) is bounded alike: no pass computes more
        # tokens than were reserved
        if r.tokens + computed_tokens > r.reserved:
            raise UsageError(f"request {r.request_id!r}: {computed_tokens} tokens computed but only "
                             f"{r.reserved - r.tokens} reserved (state {r.state!r})")
        if self.quick(r, computed_tokens, new_units, checkpoint):
            return {}
        if r.state != RS.running or not self.running_result_noop:
            t.check(r, RE.forward_result)  # (in running it is an unguarded internal transition)
        adopted: PageMap = {}
        r.results += 1
        if r.ckpt_borrow is not None:
            t.drop_checkpoint_borrow(r)  # the pass that copied the checkpoint has returned
        if new_units:
            r.units.extend(new_units)
        if computing:
            r.tokens += computed_tokens
            # the state is at floor(tokens/alignment) units: without that unit's key (decode
            # units come in new_units) the checkpoint would land on an earlier unit's node
            r.retract_ckpt = checkpoint and r.tokens // t.align <= len(r.units)
        if r.state == RS.running:
            # the checkpoint at the prompt's last full unit is kept for later turns of the
            # conversation; other chunk checkpoints give way to deeper ones
            at_prompt_end = r.tokens == (r.prompt_tokens // t.align) * t.align
            adopted = self.publish(r, checkpoint=r.retract_ckpt, final=at_prompt_end)
        if r.deferred:
            t.retire_deferred(r)
        t.fire(r, RE.forward_result)
        return adopted

    def quick(self, r: Request, computed_tokens: int, new_units: Sequence[Hashable], checkpoint: bool) -> bool:
        """The hot path of :meth:`step_done` (most decode steps; arguments checked, the call
        accepted and a result owed): when no unit completes and nothing is to publish or
        free, and the spec's ``forward_result`` in ``running`` is an unguarded internal
        transition, record the result and return True; else change nothing, return False."""
        if (r.state == RS.running and self.running_result_noop and r.ckpt_borrow is None and not checkpoint
                and not r.deferred and r.passes > r.results and r.tokens + computed_tokens <= r.reserved
                and min(r.tokens + computed_tokens, (len(r.units) + len(new_units)) * self._align)
                < (r.published + 1) * self._align):
            if new_units:
                r.units.extend(new_units)
            r.tokens += computed_tokens
            r.retract_ckpt = False
            r.results += 1
            return True
        return False

    def publish(self, r: Request, checkpoint: bool, final: bool = False) -> PageMap:
        """Insert ``r``'s full units into the tree; move its lock to the new terminal.

        Returns:
            The checkpoint pages the tree adopted (state group -> page ids), which the
            engine must fill with its state at that position; empty when none.
        """
        t, core = self.table, self.core
        n_units = min(r.tokens // t.align, len(r.units))
        if n_units < r.published:
            # inside a history-replay span (tokens below the hit end are recomputed only to
            # rebuild continuation state): nothing new, and no state there is exact yet
            return {}
        if n_units == r.published and not (checkpoint and t.state_pages and n_units > 0):
            return {}
        ppu = t.pages_per_unit
        pages = {g: (r.canon.get(g, []) + r.own.get(g, []))[: n_units * ppu[g]] for g in t.history}
        ckpt = None
        if checkpoint and t.state_pages and n_units > 0 and n_units * t.align <= r.tokens:
            try:
                ckpt = core.alloc_device(dict(t.state_pages), evict=False)
            except CapacityError:
                ckpt = None
        anchor = r.lock.node if r.lock is not None and not r.lock.released else None
        if ckpt is None and anchor is not None and anchor.depth <= n_units and all(
                len(r.canon.get(g, ())) == anchor.depth * ppu[g] for g in t.history):
            # its canonical pages are its locked path's, whole (invariant forward_fence: a
            # prefix of them): the core trusts the page table and walks only beyond it
            result = core.insert_trusted(r.units[:n_units], pages, anchor, chunk_checkpoint=not final)
        else:
            result = core.insert(r.units[:n_units], pages, ckpt, chunk_checkpoint=not final, anchor=anchor)
        dup = {g: p for g, p in result.duplicates.items() if p} if result.duplicates else result.duplicates
        # own pages now published or duplicated leave the request's own list
        kept = result.kept
        for g in t.history:
            used = pages[g][len(r.canon.get(g, [])):]
            if kept.get(g):
                gone = set(used) - set(kept[g])
                r.own[g] = [p for p in r.own.get(g, []) if p not in gone]
            else:  # (``used`` is the head of its own list, whose pages are distinct)
                r.own[g] = r.own.get(g, [])[len(used):]
        if dup:
            t.free_later(r, {g: p for g, p in dup.items() if g in t.history})
            t.free_later(r, {g: p for g, p in dup.items() if g in t.state_pages})
        adopted: PageMap = {}
        if ckpt is not None:
            kept_state = {g: p for g, p in result.kept.items() if g in t.state_pages}
            t.free_later(r, kept_state)
            for g, p in ckpt.items():
                gone = set(dup.get(g, ())) | set(kept_state.get(g, ()))
                if not gone.intersection(p):
                    adopted[g] = p
        r.canon = result.pages  # (fresh lists, one per history group)
        r.published = result.published_units
        if result.node is not core.root:
            new_lock = core.lock(result.node, r.request_id)
            if r.lock is not None:
                core.unlock(r.lock)
            r.lock = new_lock
        return adopted
