"""``kvtier verify``: exhaustive bounded exploration of a small configuration.

Breadth-first over every interleaving of the enabled steps of a kit machine
(:meth:`KitMachine.kit_actions`: admissions, forward results, reservations, finishes,
retractions, resumptions, aborts, every deliverable completion succeeding or failing,
deadlines, polls), from one fixed setup. States are merged through
:meth:`KitMachine.kit_canonical` (for the facade, :mod:`kvtier.testing.canonical`: nodes
by prefix, page and op ids renumbered, clock stamps replaced by their order, what no later
step reads left out; its docstring says why each merge is sound), and every invariant (the
kit's and the machine's own ``@invariant()`` methods) is checked in every state reached.
The frontier's states are kept pickled (a few kB each) and thawed once per step. The result
is the number of distinct states, the depth reached, whether the search reached a fixpoint
(every reachable state seen), or the shortest violating trace as a kvtier event sequence.

Measured (``bench/RESULTS.md``, verify fixpoint): two requests with the prompt ``a`` plus
one token, 2 device units and 1 host unit, reach a fixpoint of 5,412 states at depth 35."""

from __future__ import annotations

import copy
import copyreg
import io
import pickle
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from hypothesis.stateful import RuleBasedStateMachine, rule

from kvtier.fsm.lifecycle.machines import Lifecycle, l3_lifecycle, node_lifecycle, request_lifecycle, transfer_lifecycle

from .machines import FacadeMachine, KitMachine
from .sequence import EventSequence, Step, check_all, classify, machine_name

__all__ = ["VerifyResult", "verify", "clone"]


class _Bare(RuleBasedStateMachine):
    @rule()
    def nothing(self) -> None:
        pass


_HYPO_ATTRS: frozenset[str] | None = None


def _hypothesis_attrs() -> frozenset[str]:
    global _HYPO_ATTRS
    if _HYPO_ATTRS is None:
        _HYPO_ATTRS = frozenset(vars(_Bare()))
    return _HYPO_ATTRS


def _shared(machine: KitMachine) -> dict[int, Any]:
    """The objects every copy shares (by id): the lifecycle machines and the layout."""
    shared = [node_lifecycle(), request_lifecycle()]
    cache = getattr(machine, "cache", None)
    if cache is not None:
        shared.append(cache.layout)
    return {id(o): o for o in shared}


def clone(machine: KitMachine) -> KitMachine:
    """An independent copy of ``machine`` (Hypothesis' own bookkeeping and the shared
    lifecycle machines are shared, everything else is deep-copied)."""
    hypo = _hypothesis_attrs()
    memo: dict[int, Any] = dict(_shared(machine))
    new = object.__new__(type(machine))
    state = {k: v for k, v in vars(machine).items() if k not in hypo and k != "kit_trace"}
    new.__dict__.update({k: v for k, v in vars(machine).items() if k in hypo})
    new.__dict__.update(copy.deepcopy(state, memo))
    new.kit_trace = list(machine.kit_trace)
    return new


def _reduce_lifecycle(lc: Lifecycle) -> tuple[Callable[[], Lifecycle], tuple[()]]:
    """Pickle a shared lifecycle machine by reference to its (cached) constructor."""
    for shared in (node_lifecycle, request_lifecycle, l3_lifecycle, transfer_lifecycle):
        if lc is shared():
            return shared, ()
    raise pickle.PicklingError(f"a lifecycle machine that is not shared: {lc!r}")


_DISPATCH = {**copyreg.dispatch_table, Lifecycle: _reduce_lifecycle}


class _Snapshots:
    """Frozen machine states for the search: the machine's own attributes pickled (the
    shared lifecycle machines by reference, Hypothesis' bookkeeping left out and shared),
    thawed into an independent copy per step. A thaw costs about a quarter of a
    :func:`copy.deepcopy` of the machine (freezing, once per new state, about half) and a
    frozen state takes a few kB; a machine whose state does not pickle falls back to
    :func:`clone` (the frozen state is then a machine)."""

    def __init__(self, root: KitMachine) -> None:
        self.cls = type(root)
        hypo = _hypothesis_attrs()
        self.hypo = {k: v for k, v in vars(root).items() if k in hypo}
        self.pickles = True
        try:
            self.thaw(self.freeze(root))
        except (pickle.PicklingError, TypeError, AttributeError):
            self.pickles = False

    def freeze(self, m: KitMachine) -> Any:
        if not self.pickles:
            return clone(m)
        hypo = _hypothesis_attrs()
        state = {k: v for k, v in vars(m).items() if k not in hypo and k != "kit_trace"}
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.dispatch_table = _DISPATCH
        pickler.dump(state)
        return buf.getvalue()

    def thaw(self, blob: Any) -> KitMachine:
        if not isinstance(blob, bytes):
            return clone(blob)
        new = object.__new__(self.cls)
        new.__dict__.update(self.hypo)
        new.__dict__.update(pickle.loads(blob))
        new.kit_trace = []
        return new


@dataclass
class VerifyResult:
    """What :func:`verify` found.

    Attributes:
        states: distinct (canonical) states reached, the initial one included.
        transitions: steps executed (edges explored).
        depth: the deepest level fully explored.
        fixpoint: True when no new state appeared: every reachable state was seen.
        violation: the shortest violating trace (an event sequence), or ``None``.
        invariant, message: what it violated.
        seconds: wall time.
        per_depth: new states per level.
        stopped: why the search stopped early (time or state limit), else ``""``.
        merges_checked: with ``check_merges``, the merged states whose successors were
            compared with those of the state they were merged into.
        merge_mismatch: with ``check_merges``, the traces of two states the canonical
            form merged although their successors differ (a defect of the abstraction,
            not of the system under test), else ``None``.
    """

    states: int = 0
    transitions: int = 0
    depth: int = 0
    fixpoint: bool = False
    violation: EventSequence | None = None
    invariant: str | None = None
    message: str = ""
    seconds: float = 0.0
    per_depth: list[int] = field(default_factory=list)
    stopped: str = ""
    merges_checked: int = 0
    merge_mismatch: tuple[EventSequence, EventSequence] | None = None

    @property
    def ok(self) -> bool:
        return self.violation is None and self.merge_mismatch is None

    def report(self) -> str:
        lines = [f"states explored: {self.states:,} distinct ({self.transitions:,} steps executed) "
                 f"in {self.seconds:.1f} s",
                 f"depth reached: {self.depth}" + (" (fixpoint: every reachable state seen)" if self.fixpoint
                                                   else f"; new states per level: {self.per_depth}")]
        if self.stopped:
            lines.append(f"stopped early: {self.stopped}")
        if self.merges_checked:
            lines.append(f"merges checked: {self.merges_checked:,} merged states had the successors of the "
                         f"state they were merged into")
        if self.merge_mismatch is not None:
            lines.append("MERGE MISMATCH: two states with one canonical value have different successors:")
            lines.extend(seq.render() for seq in self.merge_mismatch)
        if self.violation is not None:
            lines.append(f"VIOLATION of {self.invariant}: {self.message}")
            lines.append(f"shortest violating trace ({len(self.violation.steps)} steps):")
            lines.append(self.violation.render())
        else:
            lines.append("no invariant violated in any state reached")
        return "\n".join(lines)


def verify(depth: int, *, machine: type[KitMachine] = FacadeMachine, setup: Step | None = None,
           max_states: int | None = None, seconds: float | None = None,
           progress: Callable[[int, int, int], None] | None = None,
           check_merges: int = 0) -> VerifyResult:
    """Explore every interleaving up to ``depth`` steps after the setup.

    Args:
        depth: the bound on steps after the setup.
        machine: the kit machine class (must implement ``kit_actions`` and ``kit_canonical``).
        setup: the setup step (default: ``machine.verify_setup()``).
        max_states: stop early (reported in ``stopped``) past this many states.
        seconds: stop early (reported in ``stopped``) past this many seconds.
        progress: called with (level, frontier size, states so far) after each level.
        check_merges: cross-check the canonical form this many steps ahead (0: off; 1
            costs about 3x the time, each further step multiplies that by the branching):
            every state merged into one seen before must have the same successors (their
            canonical values as a set, each with its successors, to that depth) and the
            same check outcomes; a difference stops the search (``merge_mismatch``). A
            difference that shows only later is not seen: a test of the abstraction, not
            a proof.
    """
    t0 = time.perf_counter()
    res = VerifyResult()
    root = machine()
    first = setup if setup is not None else machine.verify_setup()  # type: ignore[attr-defined]
    root.kit_replaying = True
    getattr(root, first.rule)(**first.args)
    check_all(root)
    snaps = _Snapshots(root)
    seen: set[Hashable] = {root.kit_canonical()}
    reps: dict[Hashable, tuple[Any, list[Step]]] = {}  # check_merges: the first state of each value
    succ: dict[Hashable, frozenset[Hashable]] = {}

    def successors(blob: Any, ahead: int) -> frozenset[Hashable]:
        """The canonical values of the successors, each with its own successors up to
        ``ahead`` steps (a failing check counts as an outcome)."""
        out: set[Hashable] = set()
        for step in snaps.thaw(blob).kit_actions():
            m = snaps.thaw(blob)
            try:
                getattr(m, step.rule)(**step.args)
                check_all(m)
                key = m.kit_canonical()
            except Exception as exc:  # noqa: BLE001 - a check failing counts as an outcome
                out.add(("failed", classify(exc)[0]))
                continue
            out.add((key, successors(snaps.freeze(m), ahead - 1) if ahead > 1 else None))
        return frozenset(out)

    if check_merges:
        reps[next(iter(seen))] = (snaps.freeze(root), list(root.kit_trace))
    # the frontier: (frozen state, its trace, its enabled steps) per new state of the level
    frontier: list[tuple[Any, list[Step], list[Step]]] = [(snaps.freeze(root), list(root.kit_trace),
                                                            root.kit_actions())]
    res.states = 1
    name = machine_name(machine)
    for level in range(1, depth + 1):
        nxt: list[tuple[Any, list[Step], list[Step]]] = []
        new_here = 0
        for blob, trace, actions in frontier:
            for step in actions:
                child = snaps.thaw(blob)
                child.kit_trace = list(trace)
                res.transitions += 1
                try:
                    getattr(child, step.rule)(**step.args)
                    check_all(child)  # the kit's invariants and the machine's own
                    key = child.kit_canonical()  # (which may check what it abstracts away)
                except Exception as exc:  # noqa: BLE001 - a failure of the system under test
                    res.invariant, res.message = classify(exc)
                    res.violation = EventSequence(
                        name, list(child.kit_trace), "verify-violation",
                        f"shortest violating trace found by kvtier verify (depth {level})",
                        {"outcome": "violation", "invariant": res.invariant})
                    res.states = len(seen)
                    res.depth = level
                    res.seconds = time.perf_counter() - t0
                    return res
                if key in seen:
                    if check_merges:
                        rep_blob, rep_trace = reps[key]
                        if key not in succ:
                            succ[key] = successors(rep_blob, check_merges)
                        res.merges_checked += 1
                        if successors(snaps.freeze(child), check_merges) != succ[key]:
                            res.merge_mismatch = (
                                EventSequence(name, rep_trace, "verify-merged-first", "the state merged into"),
                                EventSequence(name, list(child.kit_trace), "verify-merged", "the state merged"))
                            res.stopped = f"merge mismatch at depth {level}"
                    if not res.stopped:
                        continue
                else:
                    seen.add(key)
                    frozen = snaps.freeze(child)
                    nxt.append((frozen, child.kit_trace, child.kit_actions()))
                    if check_merges:
                        reps[key] = (frozen, list(child.kit_trace))
                    new_here += 1
                if max_states is not None and len(seen) >= max_states:
                    res.stopped = f"state limit {max_states:,} reached at depth {level}"
                if seconds is not None and time.perf_counter() - t0 > seconds:
                    res.stopped = f"time limit {seconds:g} s reached at depth {level}"
                if res.stopped:
                    res.states = len(seen)
                    res.depth = level - 1
                    res.per_depth.append(new_here)
                    res.seconds = time.perf_counter() - t0
                    return res
        res.states = len(seen)
        res.per_depth.append(new_here)
        frontier = nxt
        res.depth = level
        if progress is not None:
            progress(level, len(frontier), len(seen))
        if not frontier:
            res.fixpoint = True
            res.depth = level - 1
            break
    res.seconds = time.perf_counter() - t0
    return res
