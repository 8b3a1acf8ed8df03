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
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from transitions import Machine

from ..errors import GuardRejected, IllegalTransition
from .guards import GUARDS, Guard
from .spec import INTERNAL, GuardRef, LifecycleSpec, TransitionSpec, load_spec

__all__ = ["Lifecycle", "Observer", "node_lifecycle", "request_lifecycle", "l3_lifecycle"]

#: ``(lifecycle, subject, event, source state, dest state)`` -> None, called after a transition.
Observer = Callable[["Lifecycle", Any, str, str, str], None]

_tlog = logging.getLogger("transitions")
if _tlog.level == logging.NOTSET:
    # transitions logs several INFO lines per trigger: 3x slower at INFO (spec/README.md, Sources).
    _tlog.setLevel(logging.WARNING)


def _condition(guard: Guard) -> Callable[..., bool]:
    def condition(event_data: Any) -> bool:
        return guard(event_data.model)

    return condition


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
        """Trigger ``event`` on ``subject`` through the transitions machine.

        Returns:
            The subject's new state.

        Raises:
            IllegalTransition, GuardRejected: as :meth:`check`; the subject is unchanged.
        """
        state: str = subject.state
        key = (state, event)
        if key not in self._table:
            raise IllegalTransition(self.name, self.describe(subject), state, event)
        if key in self._noop:
            if self.observer is not None:
                self.observer(self, subject, event, state, state)
            return state
        if not self._events[event].trigger(subject):
            self.check(subject, event)  # raises GuardRejected naming the guards
            raise AssertionError("transitions refused an event whose guards hold")  # pragma: no cover
        new_state: str = subject.state
        if self.observer is not None:
            self.observer(self, subject, event, state, new_state)
        return new_state


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
