"""Lifecycle coverage, computed from the spec at run time.

The items are read from the spec (``kvtier.spec/lifecycle.toml``) when a
:class:`LifecycleCoverage` is made, so a transition added to the spec is reported as
never exercised until some test fires it:

- every transition row (lifecycle, source, event, guards -> dest);
- every guard of every lifecycle, seen true and seen false;
- every (state, event) pair the spec does not allow, seen rejected.

Hits are attributed to a *source* (the machine running). The *product* sources are the
machines that drive the real core or facade (``core``, ``facade``, engines' own); the
raw lifecycle machines fire events at the spec's machines directly. What the product
must drive (:meth:`LifecycleCoverage.product_required`) is every transition and every
guard value some transition accepts with; a guard value that only refuses (``unlocked =
false``, ``has_device_child = true``) is exempt, since a correct core never fires a
trigger its guards refuse, and so are rejections.

Recording wraps :meth:`kvtier.fsm.lifecycle.machines.Lifecycle.fire` and ``check`` in the test
process (``with coverage.recording(): ...``); ``fsm/`` itself is not changed. A guard's
value is recorded whenever a candidate transition that names it is considered.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvtier.fsm.errors import IllegalTransition
from kvtier.fsm.lifecycle.machines import Lifecycle
from kvtier.fsm.lifecycle.spec import INTERNAL, Specification, TransitionSpec, load_spec

__all__ = ["CoverageItem", "LifecycleCoverage", "transition_label", "UNREACHABLE_BY_PRODUCT"]

#: Spec transitions a correct core and facade never take, with the reason (exempt from
#: the product requirement, listed in every report; the raw request machine fires them).
#: Abort poisons the request's own writebacks (``fsm/request/ends.py``, ``Ender.abort``),
#: so in ``aborting`` they always end in ``writeback_fail``; and an aborting request owns
#: at most one writeback (from ``finishing`` or ``retracting``, both entered settled: no
#: forward result, no loadback), so that failure always settles it.
UNREACHABLE_BY_PRODUCT: dict[str, str] = {
    "request: aborting --writeback_ack [settled]--> aborted":
        "abort poisons its own writeback: it ends in writeback_fail",
    "request: aborting --writeback_ack [!settled]--> aborting":
        "abort poisons its own writeback: it ends in writeback_fail",
    "request: aborting --writeback_fail [!settled]--> aborting":
        "an aborting request's own writeback is its only owed item (finishing and retracting are entered settled)",
    "node: fetching --split--> fetching":
        "an L3 get reserves one node per unit (fsm/node/fetch.py), and a split cuts inside a node, so a fetching "
        "node is never split",
}


def transition_label(lifecycle: str, t: TransitionSpec) -> str:
    guards = f" [{', '.join(g.label for g in t.guards)}]" if t.guards else ""
    dest = t.source if t.dest == INTERNAL else t.dest
    return f"{lifecycle}: {t.source} --{t.event}{guards}--> {dest}"


@dataclass(frozen=True, order=True)
class CoverageItem:
    """One thing to exercise: ``kind`` is ``transition``, ``guard`` or ``rejection``."""

    kind: str
    label: str


class LifecycleCoverage:
    """What the lifecycles did while recording, against everything the spec allows.

    Attributes:
        source: label of whatever is running now (e.g. ``"core"``); hits are
            attributed to it.
    """

    def __init__(self, spec: Specification | None = None) -> None:
        self.spec = spec or load_spec()
        self.items: list[CoverageItem] = []
        self._row_item: dict[tuple[str, str, str, tuple[Any, ...]], CoverageItem] = {}
        self._guard_item: dict[tuple[str, str, bool], CoverageItem] = {}
        self._reject_item: dict[tuple[str, str, str], CoverageItem] = {}
        for lc in self.spec.lifecycles:
            for t in lc.transitions:
                item = CoverageItem("transition", transition_label(lc.name, t))
                self._row_item[(lc.name, t.source, t.event, t.guards)] = item
                self.items.append(item)
            for g in lc.guards:
                for value in (True, False):
                    item = CoverageItem("guard", f"{lc.name}: {g} = {str(value).lower()}")
                    self._guard_item[(lc.name, g, value)] = item
                    self.items.append(item)
            for s in lc.state_names:
                for e in lc.events:
                    if not lc.candidates(s, e):
                        item = CoverageItem("rejection", f"{lc.name}: {e} in {s}")
                        self._reject_item[(lc.name, s, e)] = item
                        self.items.append(item)
        #: guard values some transition accepts with (the others only refuse)
        self._accepting: set[CoverageItem] = set()
        for lc in self.spec.lifecycles:
            for t in lc.transitions:
                for ref in t.guards:
                    self._accepting.add(self._guard_item[(lc.name, ref.name, not ref.negated)])
        self.hits: dict[CoverageItem, Counter[str]] = {i: Counter() for i in self.items}
        self.source = "-"
        self.fires = 0

    # -- recording -------------------------------------------------------------------
    def _hit(self, item: CoverageItem | None) -> None:
        if item is not None:
            self.hits[item][self.source] += 1

    def _observe(self, lc: Lifecycle, subject: Any, event: str) -> tuple[str, TransitionSpec | None]:
        state = subject.state
        rows = lc.spec.candidates(state, event)
        chosen = None
        for t in rows:
            ok = True
            for g in t.guards:
                value = bool(lc.guards[g.name](subject))
                self._hit(self._guard_item.get((lc.name, g.name, value)))
                ok = ok and value != g.negated
            if ok and chosen is None:
                chosen = t
        return state, chosen

    @contextlib.contextmanager
    def recording(self) -> Iterator[LifecycleCoverage]:
        """Record every ``fire`` and ``check`` of every lifecycle while inside."""
        orig_fire = Lifecycle.fire
        orig_check = Lifecycle.check
        cov = self

        def fire(lc: Lifecycle, subject: Any, event: str) -> str:
            state, chosen = cov._observe(lc, subject, event)
            try:
                out = orig_fire(lc, subject, event)
            except IllegalTransition:
                cov._hit(cov._reject_item.get((lc.name, state, event)))
                raise
            cov.fires += 1
            if chosen is not None:
                cov._hit(cov._row_item.get((lc.name, chosen.source, chosen.event, chosen.guards)))
            return out

        def check(lc: Lifecycle, subject: Any, event: str) -> str:
            state, _ = cov._observe(lc, subject, event)
            try:
                return orig_check(lc, subject, event)
            except IllegalTransition:
                cov._hit(cov._reject_item.get((lc.name, state, event)))
                raise

        setattr(Lifecycle, "fire", fire)
        setattr(Lifecycle, "check", check)
        try:
            yield self
        finally:
            setattr(Lifecycle, "fire", orig_fire)
            setattr(Lifecycle, "check", orig_check)

    @contextlib.contextmanager
    def attributed(self, source: str) -> Iterator[None]:
        """Attribute hits inside to ``source``."""
        before, self.source = self.source, source
        try:
            yield
        finally:
            self.source = before

    # -- reporting ---------------------------------------------------------------------
    def covered(self, kind: str | None = None, sources: set[str] | None = None) -> list[CoverageItem]:
        return [i for i in self.items if (kind is None or i.kind == kind)
                and any(n for s, n in self.hits[i].items() if sources is None or s in sources)]

    def missing(self, kind: str | None = None, sources: set[str] | None = None) -> list[CoverageItem]:
        done = set(self.covered(kind, sources))
        return [i for i in self.items if (kind is None or i.kind == kind) and i not in done]

    def totals(self, sources: set[str] | None = None) -> dict[str, tuple[int, int]]:
        """kind -> (covered, total)."""
        out = {}
        for kind in ("transition", "guard", "rejection"):
            total = sum(1 for i in self.items if i.kind == kind)
            out[kind] = (len(self.covered(kind, sources)), total)
        return out

    @property
    def complete(self) -> bool:
        return not self.missing()

    def product_required(self) -> list[CoverageItem]:
        """What the product must drive: every transition and every accepting guard value."""
        return [i for i in self.items
                if (i.kind == "transition" and i.label not in UNREACHABLE_BY_PRODUCT) or i in self._accepting]

    def product_exempt(self) -> list[CoverageItem]:
        """Guard values that only refuse (exempt from the product requirement)."""
        return [i for i in self.items if i.kind == "guard" and i not in self._accepting]

    def product_missing(self, sources: set[str]) -> list[CoverageItem]:
        """Items of :meth:`product_required` never hit by any of ``sources``."""
        done = set(self.covered(None, sources))
        return [i for i in self.product_required() if i not in done]

    def merge(self, other: LifecycleCoverage) -> None:
        for item, counts in other.hits.items():
            if item in self.hits:
                self.hits[item].update(counts)
        self.fires += other.fires

    def summary(self, sources: set[str] | None = None) -> str:
        t = self.totals(sources)
        return ", ".join(f"{k}s {c}/{n}" for k, (c, n) in t.items())

    def report(self, by_source: tuple[str, ...] = (), full: bool = True) -> str:
        """Multi-line report: totals, totals per source, and every item never exercised
        (only their count when ``full`` is false)."""
        lines = [f"coverage (from the spec): {self.summary()}"]
        for src in by_source:
            lines.append(f"  by {src}: {self.summary({src})}")
        miss = self.missing()
        if miss and not full:
            lines.append(f"never exercised: {len(miss)} items (kvtier fuzz --verbose lists them)")
        elif miss:
            lines.append(f"never exercised ({len(miss)}):")
            lines.extend(f"  - {i.kind}: {i.label}" for i in miss)
        else:
            lines.append("never exercised: nothing (full coverage)")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"totals": {k: list(v) for k, v in self.totals().items()},
                "missing": [[i.kind, i.label] for i in self.missing()],
                "hits": {f"{i.kind}: {i.label}": dict(self.hits[i]) for i in self.items}}
