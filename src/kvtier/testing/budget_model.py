"""Pool sizing from a byte budget against its definition (``model_budget``).

:func:`kvtier.transfer.pools.pages_for_budget` splits a byte budget into page counts per
cache group: each group gets the share ``weights[g] / sum(weights)`` of the budget (equal
shares without weights) and as many whole pages as fit in it, a page being the bytes of
every component in every layer of the group; a group whose share holds no page is a
``ConfigError``. :func:`check_budget_split` restates that from the spec's fields
(:class:`~kvtier.fsm.records.CacheGroupSpec`: components' ``page_bytes`` times the group's
layers; exact fractions, with a tolerance of a few parts in 10^12 for the float share the
product computes) and checks an answer: never more bytes than the budget, nor than a
group's share, and no group that could take one more whole page within its share (the
budget used as fully as whole pages allow). The engine machine checks the split of a
budget near its host pool's size at every example (:mod:`kvtier.testing.engine_plug`);
``tests/kit`` runs it as a Hypothesis property over random geometries, budgets and weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from kvtier.fsm import ConfigError

from .models import ModelViolation

__all__ = ["group_page_bytes", "check_budget_split", "check_split_of_pool"]

_EPS = Fraction(1, 10**12)


def group_page_bytes(spec: Any) -> int:
    """Bytes of one page of ``spec``: every component's page in every layer."""
    return sum(int(c.page_bytes) for c in spec.components) * len(spec.layers)


def _fail(what: str) -> None:
    raise ModelViolation("model_budget", "pages_for_budget", what)


def check_budget_split(specs: Sequence[Any], budget: int, weights: Mapping[str, float] | None = None) -> \
        dict[str, int] | None:
    """``pages_for_budget(specs, budget, weights)`` against the definition (module doc);
    returns its answer, or ``None`` when it raised the ``ConfigError`` the definition asks
    for (a group whose share holds no page).

    Raises:
        ModelViolation: ``model_budget``: a group over its share or the budget, a group
            that could hold one more page, a missing or extra group, or a ``ConfigError``
            raised (or not raised) against the definition.
    """
    from kvtier.transfer.pools import pages_for_budget

    w = {s.name: Fraction(1) if weights is None else Fraction(float(weights[s.name])) for s in specs}
    total = sum(w.values())
    share = {name: Fraction(budget) * x / total for name, x in w.items()}
    pb = {s.name: group_page_bytes(s) for s in specs}
    starved = [n for n in share if share[n] * (1 + _EPS) < pb[n]]
    edge = [n for n in share if abs(share[n] - pb[n]) <= share[n] * _EPS]
    try:
        got: dict[str, int] = {str(k): int(v) for k, v in pages_for_budget(specs, budget, weights).items()}
    except ConfigError as e:
        if starved or edge:
            return None
        _fail(f"budget {budget} bytes, weights {weights}: raised {e}, but every group's share holds a page "
              f"(shares {dict((n, float(s)) for n, s in share.items())}, page bytes {pb})")
        raise  # (unreachable)
    if starved:
        _fail(f"budget {budget} bytes: groups {starved} get less than one page ({pb}) but no ConfigError; got {got}")
    if set(got) != set(pb):
        _fail(f"budget {budget} bytes: pages for groups {sorted(got)}, the groups are {sorted(pb)}")
    used = sum(got[n] * pb[n] for n in pb)
    if used > budget:
        _fail(f"budget {budget} bytes: the pages {got} take {used} bytes (page bytes {pb})")
    for n in pb:
        if got[n] * pb[n] > share[n] * (1 + _EPS):
            _fail(f"budget {budget} bytes: group {n!r} gets {got[n]} pages = {got[n] * pb[n]} bytes, over its "
                  f"share of {float(share[n]):.1f} bytes")
        if (got[n] + 1) * pb[n] < share[n] * (1 - _EPS):
            _fail(f"budget {budget} bytes: group {n!r} gets {got[n]} pages of {pb[n]} bytes; its share of "
                  f"{float(share[n]):.1f} bytes holds {int(share[n] // pb[n])}")
    return got


def check_split_of_pool(specs: Sequence[Any], pages: Mapping[str, int], slack: int) -> None:
    """:func:`check_budget_split` of the budget that holds ``pages`` (group -> pages) plus
    ``slack`` bytes, weighted by each group's bytes: the split must give back ``pages``
    when ``slack`` is below every group's page (``slack`` is cut to that)."""
    pb = {s.name: group_page_bytes(s) for s in specs}
    sizes = {n: max(1, int(pages.get(n, 1))) * pb[n] for n in pb}
    slack = slack % min(pb.values())
    budget = sum(sizes.values()) + slack
    got = check_budget_split(specs, budget, {n: float(b) for n, b in sizes.items()})
    want = {n: sizes[n] // pb[n] for n in pb}
    if got is not None and slack == 0 and got != want:
        _fail(f"budget {budget} bytes weighted by the pool's own bytes {sizes}: pages {got}, not {want}")
