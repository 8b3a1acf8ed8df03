"""The base of the kit's machines: step recording, run counters, named invariant checks,
configuration, and what the rules of several machines share (the kit's small layout,
the fault roll, the terminal request states).

Fault injection: ``fault_rate`` (class attribute; :meth:`KitMachine.configured`) is the
chance that a delivered completion reports failure; ``world_size`` fixes the number of
tensor-parallel ranks (else drawn from 1 and 2).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant

from kvtier.fsm import CacheGroupSpec, ComponentSpec, Family
from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.request import TERMINAL as _REQUEST_TERMINAL
from kvtier.fsm.spec import load_spec

from .sequence import EventSequence, Step, machine_name

__all__ = ["KitMachine", "RunStats", "STATS", "recorded", "kit_layout", "INVARIANTS", "ROLL", "TERMINAL"]

F = TypeVar("F", bound=Callable[..., Any])

#: The invariant names of the spec (what failures print).
INVARIANTS: tuple[str, ...] = tuple(load_spec().invariants)


@dataclass
class RunStats:
    """Process-wide counters of kit machines (the fuzz driver reads and resets them)."""

    steps: int = 0
    checks: int = 0
    examples: int = 0

    def reset(self) -> None:
        self.steps = self.checks = self.examples = 0


STATS = RunStats()
_CURRENT: list[KitMachine] = []


def recorded(fn: F) -> F:
    """Record each call of a rule as a :class:`Step` of the running machine."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: KitMachine, **kwargs: Any) -> Any:
        self.kit_trace.append(Step.of(name, kwargs))
        STATS.steps += 1
        return fn(self, **kwargs)

    return wrapper  # type: ignore[return-value]


def kit_layout(with_state: bool = False) -> CacheLayout:
    """The small layout the kit machines use: history ``kv`` (2 tokens per page) and
    ``c4`` (4 tokens per page, two components), alignment 4 tokens, 3 layers; with
    ``with_state`` a continuation-state group ``swa`` (window 4 tokens: 2 pages)."""
    groups = [
        CacheGroupSpec("kv", Family.HISTORY, 2, 1, (0, 1, 2), (ComponentSpec("k", 64),)),
        CacheGroupSpec("c4", Family.HISTORY, 1, 4, (1, 2), (ComponentSpec("c", 32), ComponentSpec("i", 16))),
    ]
    if with_state:
        groups.append(CacheGroupSpec("swa", Family.STATE, 2, 1, (0, 1, 2), (ComponentSpec("s", 64),), window=4))
    return CacheLayout("kvtier-testing", tuple(groups), 3)


class KitMachine(RuleBasedStateMachine):
    """Base of the kit's machines: step recording, named invariant checks, configuration.

    Subclasses list their invariant-check methods in ``kit_invariants`` (each raises
    :class:`InvariantViolation` naming a spec invariant).
    """

    kit_invariants: ClassVar[tuple[str, ...]] = ()
    #: chance that a delivered completion fails (0..1)
    fault_rate: ClassVar[float] = 0.25
    #: tensor-parallel ranks; ``None``: drawn from 1 and 2
    world_size: ClassVar[int | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.kit_trace: list[Step] = []
        self.kit_replaying = False
        STATS.examples += 1
        _CURRENT[:] = [self]

    # -- configuration -------------------------------------------------------------
    @classmethod
    def configured(cls, **attrs: Any) -> type[KitMachine]:
        """A subclass with class attributes replaced (``fault_rate``, ``world_size``, ...)."""
        meta: Any = type(cls)
        sub: type[KitMachine] = meta(cls.__name__, (cls,), dict(attrs))
        sub.__qualname__ = cls.__qualname__
        sub.__module__ = cls.__module__
        return sub

    def kit_fail(self, roll: int) -> bool:
        """Whether a completion drawn with ``roll`` (0..999) fails under ``fault_rate``."""
        return roll < int(round(self.fault_rate * 1000))

    def kit_set_args(self, **args: Any) -> None:
        """Replace the recorded arguments of the step now running (effective values)."""
        last = self.kit_trace[-1]
        self.kit_trace[-1] = Step.of(last.rule, args)

    # -- invariants ----------------------------------------------------------------
    def kit_check(self) -> None:
        """Run every invariant check of this machine."""
        STATS.checks += 1
        for name in self.kit_invariants:
            getattr(self, name)()

    @invariant()
    def kit_all_invariants(self) -> None:
        self.kit_check()

    # -- sequences -----------------------------------------------------------------
    def kit_sequence(self, name: str = "sequence", description: str = "") -> EventSequence:
        """This run so far as a kvtier event sequence."""
        base = type(self)
        while base.__name__ == base.__mro__[1].__name__:  # configured() copies
            base = base.__mro__[1]
        return EventSequence(machine_name(base), list(self.kit_trace), name, description)

    @staticmethod
    def kit_current() -> KitMachine | None:
        """The machine most recently created in this process (the last example run)."""
        return _CURRENT[0] if _CURRENT else None

    # -- bounded verification (kvtier verify) ---------------------------------------
    def kit_actions(self) -> list[Step]:
        """Every step enabled now, with arguments from a small finite domain."""
        raise NotImplementedError(f"{type(self).__name__} does not support bounded verification")

    def kit_canonical(self) -> Hashable:
        """An abstraction of the state: equal for states that behave the same."""
        raise NotImplementedError(f"{type(self).__name__} does not support bounded verification")


#: A completion's fault roll (0..999), compared with ``fault_rate`` by :meth:`KitMachine.kit_fail`.
ROLL = st.integers(0, 999)
#: The request states a request ends in.
TERMINAL = tuple(sorted(_REQUEST_TERMINAL))
