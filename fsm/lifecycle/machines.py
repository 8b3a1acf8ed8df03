"""The lifecycle state machines, built from the spec with ``transitions``.

One shared ``transitions.Machine`` per lifecycle (``model=None``,
``auto_transitions=False``, ``queued=False``) drives any number of plain subject
objects: a subject only needs a ``state`` attribute (``__slots__`` is fine) and the
attributes its guards read (:mod:`kvtier.fsm.lifecycle.guards`). Triggering goes through
``machine.events[name].trigger(subject)``, so no per-subject model is registered
(``add_model`` costs ~6.5 KB and 37-240 us per object; ``spec/README.md``, Sources:
transitions costs).

:meth:`Lifecycle.fire` never returns ``False``: an event with no transition from the
subject's state raises :class:`IllegalTransition`; one whose guards are false raises
:class:`GuardRejected` naming the guards. Both leave the subject unchanged. Effects
(pages, counters) are never done in ``transitions`` callbacks: the core validates
first (:meth:`Lifecycle.check`), commits its effects, then fires.

Observation (the event log, :mod:`kvtier.eventlog`): :attr:`Lifecycle.observer`, when not
``None``, is called after every transition :meth:`fire` makes, internal ones included,
with ``(lifecycle, subject, event, source_state, dest_state)``; refused events change
nothing and are not reported. With no observer the cost is one attribute test per fire.

The compiled table (the hot path): :meth:`Lifecycle.fire` does not enter ``transitions`` on
every event. At construction each lifecycle derives from its built ``transitions.Machine``
(the machine's own ``events`` and their transitions, not the spec a second time) a table
``(state, event) -> ((guard, value)..., dest)`` and fires through it: the same guards in the
same order, the first transition whose guards hold wins, exactly as ``transitions`` decides.
In the *checked mode* every fire also triggers the ``transitions`` machine on a probe that
reads the subject's guard attributes, and raises :class:`InvariantViolation`
(``compiled_lifecycle``) on any difference of outcome (a new state, an illegal event, a
rejection). It is on in ``kvtier fuzz``, the testing kit, the test suite and wherever the
environment variable ``KVTIER_CHECKED_LIFECYCLE=1`` is set; :func:`set_checked` turns it on or
off for every lifecycle of the process. ``bench/lifecycle.py`` measures both modes.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from transitions import Machine, MachineError

from ..errors import GuardRejected, IllegalTransition, InvariantViolation
from .guards import GUARDS, Guard
from .spec import INTERNAL, GuardRef, LifecycleSpec, TransitionSpec, load_spec

__all__ = ["Lifecycle", "Observer", "CompiledRow", "CHECKED_ENV", "compile_machine", "set_checked",
           "node_lifecycle", "request_lifecycle", "l3_lifecycle", "transfer_lifecycle"]

#: ``(lifecycle, subject, event, source state, dest state)`` -> None, called after a transition.
Observer = Callable[["Lifecycle", Any, str, str, str], None]

_tlog = logging.getLogger("transitions")
if _tlog.level == logging.NOTSET:
    # transitions logs several INFO lines per trigger: 3x slower at INFO (spec/README.md, Sources).
    _tlog.setLevel(logging.WARNING)


#: the environment variable that turns the checked mode on for the whole process ("1").
CHECKED_ENV = "KVTIER_CHECKED_LIFECYCLE"
#: the checked mode of lifecycles built from now on (:func:`set_checked` changes it).
_checked_default = os.environ.get(CHECKED_ENV, "") == "1"
#: every lifecycle built so far (four per process: node, request, l3, transfer; tests build more).
_built: list["Lifecycle"] = []

#: one compiled transition: the guards with the value each must return, then the destination
#: state (``None``: an internal transition, the state does not change).
CompiledRow = tuple[tuple[tuple[Guard, bool], ...], str | None]


def _condition(guard: Guard) -> Callable[..., bool]:
    def condition(event_data: Any) -> bool:
        return guard(event_data.model)

    condition.guard = guard  # type: ignore[attr-defined]  # read back by compile_machine
    return condition


def compile_machine(machine: Machine) -> dict[tuple[str, str], tuple[CompiledRow, ...]]:
    """The transition table of a built ``transitions.Machine`` whose conditions were made by
    this module: ``(source state, event) -> rows`` in the order ``transitions`` tries them.

    A row's guards are ``(guard, value)``: ``value`` True for a ``conditions`` entry, False for
    an ``unless`` entry (``transitions``' ``Condition.target``).

    Raises:
        ValueError: a condition that this module did not make (it has no guard to read back).
    """
    table: dict[tuple[str, str], tuple[CompiledRow, ...]] = {}
    for name, event in machine.events.items():
        for source, transitions in event.transitions.items():
            rows = []
            for t in transitions:
                guards = []
                for c in t.conditions:
                    guard = getattr(c.func, "guard", None)
                    if guard is None:
                        raise ValueError(f"condition {c.func!r} of {source!r} --{name}--> has no guard to compile")
                    guards.append((guard, bool(c.target)))
                rows.append((tuple(guards), t.dest))
            table[(source, name)] = tuple(rows)
    return table


class _Probe:
    """What the checked mode triggers ``transitions`` on: its own ``state``, every other
    attribute (the guards' inputs) read from the subject, so the subject never changes."""

    __slots__ = ("_subject", "state")

    def __init__(self, subject: Any, state: str) -> None:
        self._subject = subject
        self.state = state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._subject, name)


def set_checked(on: bool) -> bool:
    """Turn the checked mode on or off for every lifecycle of this process (built or not).

    Returns:
        The mode before the call (to restore it).
    """
    global _checked_default
    before = _checked_default
    _checked_default = bool(on)
    for lc in _built:
        lc.checked = _checked_default
    return before


class Lifecycle:
    """A lifecycle machine built from a :class:`LifecycleSpec` and a guard registry.

    Args:
        spec: the lifecycle's spec (states, transitions, guards).
        guards: guard name -> function of the subject; must cover every guard the spec uses.
        describe: subject -> label for error messages (default: ``"<subject> <id>"``
            from the subject's ``label`` attribute, else its ``repr``).

    Raises:
        ConfigError: (from the spec loader) on an inconsistent spec.
        KeyError: if a guard the spec uses has no function.
    """

    def __init__(self, spec: LifecycleSpec, guards: Mapping[str, Guard],
                 describe: Callable[[Any], str] | None = None) -> None:
        self.spec = spec
        self.guards: dict[str, Guard] = {name: guards[name] for name in spec.guards}
        self._describe = describe
        #: called after every transition fire() makes (see the module docstring); None: off
        self.observer: Observer | None = None
        self.machine = Machine(model=None, states=list(spec.state_names), initial=spec.initial,
                               auto_transitions=False, queued=False, send_event=True)
        for t in spec.transitions:
            self.machine.add_transition(
                t.event, t.source, None if t.dest == INTERNAL else t.dest,
                conditions=[_condition(self.guards[g.name]) for g in t.guards if not g.negated],
                unless=[_condition(self.guards[g.name]) for g in t.guards if g.negated],
                # dest None: a transitions "internal" transition (no exit/enter, cheaper)
            )
        self._events = self.machine.events
        self._table: dict[tuple[str, str], tuple[TransitionSpec, ...]] = {}
        for t in spec.transitions:
            self._table[(t.source, t.event)] = self._table.get((t.source, t.event), ()) + (t,)
        # (state, event) pairs whose only transition is internal and unguarded: firing them
        # changes nothing, so fire() returns without entering transitions (same outcome)
        self._noop = frozenset(k for k, rows in self._table.items()
                               if len(rows) == 1 and rows[0].dest == INTERNAL and not rows[0].guards)
        #: (state, event) -> compiled rows, derived from the built machine (module docstring)
        self.compiled = compile_machine(self.machine)
        #: fire through both the compiled table and transitions, and compare (module docstring)
        self.checked = _checked_default
        _built.append(self)

    # -- queries -------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec.name

    def describe(self, subject: Any) -> str:
        """Label used in errors, e.g. ``"node 7"``."""
        if self._describe is not None:
            return self._describe(subject)
        label = getattr(subject, "label", None)
        return f"{self.spec.subject} {label}" if label is not None else repr(subject)

    def allowed(self, state: str, event: str) -> bool:
        """True if the spec has any transition for ``event`` from ``state`` (guards aside)."""
        return (state, event) in self._table

    def is_noop(self, state: str, event: str) -> bool:
        """True if ``event`` in ``state`` is an unguarded internal transition (it changes nothing)."""
        return (state, event) in self._noop

    def guard_value(self, ref: GuardRef, subject: Any) -> bool:
        """Whether ``ref`` is satisfied for ``subject`` (negation applied)."""
        return self.guards[ref.name](subject) != ref.negated

    def check(self, subject: Any, event: str) -> str:
        """The state ``event`` would move ``subject`` to, without changing anything.

        Raises:
            IllegalTransition: no transition for ``event`` from the subject's state.
            GuardRejected: every candidate transition has a false guard (all named).
        """
        state: str = subject.state
        compiled = self.compiled.get((state, event))
        if compiled is not None:  # the compiled rows decide as the spec's (the checked mode compares)
            for guards, dest in compiled:
                for guard, value in guards:
                    if guard(subject) != value:
                        break
                else:
                    return state if dest is None else dest
        rows = self._table.get((state, event))
        if rows is None:
            raise IllegalTransition(self.name, self.describe(subject), state, event)
        failed: list[str] = []
        for t in rows:
            bad = [g.label for g in t.guards if not self.guard_value(g, subject)]
            if not bad:
                return t.target
            failed.extend(g for g in bad if g not in failed)
        raise GuardRejected(self.name, self.describe(subject), state, event, tuple(failed))

    # -- the trigger ---------------------------------------------------------------
    def fire(self, subject: Any, event: str) -> str:
        """Trigger ``event`` on ``subject`` through the compiled table (and, in the checked
        mode, through the ``transitions`` machine too).

        Returns:
            The subject's new state.

        Raises:
            IllegalTransition, GuardRejected: as :meth:`check`; the subject is unchanged.
            InvariantViolation: (checked mode) ``transitions`` decided otherwise.
        """
        state: str = subject.state
        key = (state, event)
        rows = self.compiled.get(key)
        if rows is None:
            if self.checked:
                self._compare(subject, event, state, "<illegal>")
            raise IllegalTransition(self.name, self.describe(subject), state, event)
        if key in self._noop:
            if self.checked:
                self._compare(subject, event, state, state)
            if self.observer is not None:
                self.observer(self, subject, event, state, state)
            return state
        for guards, dest in rows:
            for guard, value in guards:
                if guard(subject) != value:
                    break
            else:
                new_state = state if dest is None else dest
                if self.checked:
                    self._compare(subject, event, state, new_state)
                subject.state = new_state
                if self.observer is not None:
                    self.observer(self, subject, event, state, new_state)
                return new_state
        if self.checked:
            self._compare(subject, event, state, "<rejected>")
        self.check(subject, event)  # raises GuardRejected naming the guards
        raise AssertionError("the compiled table refused an event whose guards hold")  # pragma: no cover

    def _compare(self, subject: Any, event: str, state: str, compiled: str) -> None:
        """Trigger ``transitions`` on a probe of ``subject`` and fail unless it reaches the
        compiled outcome (a state, ``"<illegal>"`` or ``"<rejected>"``)."""
        probe = _Probe(subject, state)
        try:
            moved = self._events[event].trigger(probe) if event in self._events else None
        except MachineError:
            moved = None
        actual = "<illegal>" if moved is None else probe.state if moved else "<rejected>"
        if actual != compiled:
            raise InvariantViolation(
                "compiled_lifecycle", self.describe(subject),
                f"{event!r} from {state!r}: the compiled table gives {compiled!r}, transitions {actual!r}")


@functools.cache
def node_lifecycle() -> Lifecycle:
    """The node-residency lifecycle (shared, built once per process from the spec)."""
    return Lifecycle(load_spec().node, GUARDS["node"])


@functools.cache
def request_lifecycle() -> Lifecycle:
    """The request lifecycle (shared, built once per process from the spec)."""
    return Lifecycle(load_spec().request, GUARDS["request"])


@functools.cache
def l3_lifecycle() -> Lifecycle:
    """The L3 object lifecycle (shared, built once per process from the spec's ``[l3]``)."""
    spec = load_spec().l3
    assert spec is not None, "the shipped spec declares [l3]"
    return Lifecycle(spec, GUARDS["l3"])


@functools.cache
def transfer_lifecycle() -> Lifecycle:
    """The transfer operation lifecycle (shared, built once per process from the spec's ``[transfer]``)."""
    spec = load_spec().transfer
    assert spec is not None, "the shipped spec declares [transfer]"
    return Lifecycle(spec, GUARDS["transfer"])
