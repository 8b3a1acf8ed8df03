"""Reference models of forward passes in the facade machines (overlapped scheduling).

- :class:`PassModel`: the page table a forward pass reads is the one the request had
  when the pass was reserved (the engine builds its block table then). Until that pass's
  result comes back (``step_done``), every page of that table holding a full unit the
  request has computed must stay allocated and, while the request runs, hold that
  unit's content (unless a loadback it waited on failed: that pass's result is
  discarded and the failed loadback's pages go): a page the request let go of
  meanwhile (a duplicate of what another request published, a window that slid) is freed
  only after the passes that may read it returned (invariant 16, the forward fence).
- :func:`check_reserve`: an accepted reservation extends the request's reserved tokens
  from where they end when a pass is out (else from its computed tokens), counts one pass
  owed, and the page table then covers every reserved token; a refused one changes none
  of that.

Failures raise :class:`~kvtier.testing.models.ModelViolation` (``model_pass_reads``,
``model_reserve``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import _views as views
from .models import ModelViolation

if TYPE_CHECKING:
    from ..tiered import TieredCache

__all__ = ["PassModel", "check_reserve", "check_chunk_rows"]


@dataclass
class _Track:
    record: int  # id() of the request record the counts belong to
    passes: int = 0
    results: int = 0
    tables: deque[dict[str, list[int]]] = field(default_factory=deque)


class PassModel:
    """The page tables of the forward passes out, per request (see the module docstring)."""

    def __init__(self) -> None:
        self._tracks: dict[str, _Track] = {}

    def sync(self, cache: TieredCache) -> None:
        """Record the table of every pass reserved, and forget passes returned, since the last call."""
        reqs = views.requests(cache)
        for rid in [k for k in self._tracks if k not in reqs]:
            del self._tracks[rid]
        for rid, r in reqs.items():
            t = self._tracks.get(rid)
            if t is None or t.record != id(r):
                t = self._tracks[rid] = _Track(id(r), r.results, r.results)
            if r.passes > t.passes:
                table = {g: list(p) for g, p in cache.page_table(rid).items()}
                t.tables.extend(table for _ in range(r.passes - t.passes))
                t.passes = r.passes
            while t.results < r.results:
                if t.tables:
                    t.tables.popleft()
                t.results += 1

    def check_before_result(self, cache: TieredCache, rid: str, dev: Any,
                            expect: Callable[[str, int], Hashable]) -> None:
        """Before ``rid``'s oldest pass out returns: its table's pages of the units the
        request has computed are allocated and hold their content (``dev``: the device
        content model; ``expect(group, position)``: what position ``position`` of the
        request's table in ``group`` holds)."""
        t = self._tracks.get(rid)
        r = views.requests(cache).get(rid)
        if t is None or r is None or not t.tables or t.record != id(r) or r.layers_failed:
            return  # (after a failed loadback its pages may go: the pass's result is discarded)
        core = cache.core
        table = t.tables[0]
        units = r.tokens // cache.layout.alignment
        valid = r.state == "running"
        ppu = views.pages_per_unit(core)
        for g in views.history_groups(core):
            for j, p in enumerate(table.get(g, ())[: units * ppu[g]]):
                if views.device_page_free(core, g, p):
                    raise ModelViolation("model_pass_reads", f"request {rid!r} ({r.state})",
                                         f"device page {p} of {g!r} (position {j}), which its pass out reads, "
                                         f"was freed before that pass returned")
                if valid and dev.get((g, p)) != expect(g, j):
                    raise ModelViolation("model_pass_reads", f"request {rid!r}",
                                         f"device page {p} of {g!r} (position {j}), which its pass out reads, "
                                         f"holds {dev.get((g, p))!r} before that pass returned")


def check_reserve(cache: TieredCache, rid: str, before: tuple[int, int, int, int], accepted: bool,
                  tokens: int) -> None:
    """An accepted ``reserve(rid, tokens)`` moved the record from ``before`` (reserved,
    computed tokens, passes, results) as documented; a refused one left it."""
    r = views.requests(cache)[rid]
    reserved, computed, passes, results = before
    if not accepted:
        want = before
    else:
        start = reserved if passes > results else computed
        want = (max(reserved, start + tokens), computed, passes + 1, results)
    got = (r.reserved, r.tokens, r.passes, r.results)
    if got != want:
        raise ModelViolation("model_reserve", f"request {rid!r}",
                             f"reserve({tokens}) {'accepted' if accepted else 'refused'}: (reserved, tokens, "
                             f"passes, results) went {before} -> {got}, expected {want}")
    if accepted:
        core = cache.core
        table = cache.page_table(rid)
        align = cache.layout.alignment
        for g, ppu in views.pages_per_unit(core).items():
            if g not in views.history_groups(core):
                continue
            need = -(-r.reserved * ppu // align)
            if len(table.get(g, ())) < need:
                raise ModelViolation("model_reserve", f"request {rid!r}",
                                     f"{r.reserved} tokens reserved but its table of {g!r} has "
                                     f"{len(table.get(g, ()))} pages, {need} needed")


def check_chunk_rows(cache: TieredCache, rid: str, cached: int, computed: int) -> None:
    """The executor's view of a prefill chunk (``CacheLayout.chunk_rows``) against the
    request's page table: for each history group (looked up by name), the rows that
    become complete are ``[cached // stride, (cached + computed) // stride)``, the residue
    is what does not fill a row, and the request's table holds every such row (its
    reservation covers what the chunk completes)."""
    layout = cache.layout
    table = cache.page_table(rid)
    rows = layout.chunk_rows(cached, computed)
    history = tuple(views.history_groups(cache.core))
    if tuple(cr.group for cr in rows) != history:
        raise ModelViolation("model_reserve", f"request {rid!r}",
                             f"chunk_rows covers groups {[cr.group for cr in rows]}, the history groups are {history}")
    end = cached + computed
    for cr in rows:
        g = layout.group(cr.group)
        want = (end // g.stride - cached // g.stride, cached // g.stride, end % g.stride)
        if (cr.rows, cr.first_row, cr.residue_tokens) != want:
            raise ModelViolation("model_reserve", f"request {rid!r}",
                                 f"chunk_rows({cached}, {computed}) of {cr.group!r}: (rows, first, residue) "
                                 f"{(cr.rows, cr.first_row, cr.residue_tokens)}, expected {want}")
        if cr.first_row + cr.rows > len(table.get(cr.group, ())) * g.rows:
            raise ModelViolation("model_reserve", f"request {rid!r}",
                                 f"a chunk completes rows up to {cr.first_row + cr.rows} of {cr.group!r}, its "
                                 f"table of {len(table.get(cr.group, ()))} pages holds {g.rows} rows each")
