"""The kvtier error hierarchy.

Every error kvtier raises on purpose subclasses :class:`KvtierError`. Lifecycle
errors also subclass ``transitions.MachineError`` so code written against the
``transitions`` package keeps catching them.
"""

from __future__ import annotations

from transitions import MachineError

__all__ = [
    "KvtierError",
    "ConfigError",
    "UsageError",
    "SpecNameError",
    "LifecycleError",
    "IllegalTransition",
    "GuardRejected",
    "InvariantViolation",
    "UnknownOperation",
    "DuplicateCompletion",
    "CapacityError",
]


class KvtierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """A configuration value (group spec, capacity, preset, option) is invalid.

    The message names the value and what was expected.
    """


class UsageError(KvtierError, ValueError):
    """A call was made with an invalid argument, or in a state where it is not allowed
    (for example ``reserve`` for a request that is not running). Nothing was changed.

    The message names the call, the value and what was expected.
    """


class SpecNameError(KvtierError, AttributeError):
    """A state or event name that the lifecycle spec does not declare (a misspelt name in
    code): raised at import or first use, never mistaken for an illegal transition."""


class LifecycleError(KvtierError, MachineError):
    """An event was refused by a lifecycle state machine; nothing was changed.

    Attributes:
        lifecycle: ``"node"`` or ``"request"``.
        subject: what the event was for, e.g. ``"node 7"`` or ``"request 'r1'"``.
        state: the subject's state when the event was refused.
        event: the refused event's name.
    """

    def __init__(self, lifecycle: str, subject: str, state: str, event: str, detail: str) -> None:
        self.lifecycle = lifecycle
        self.subject = subject
        self.state = state
        self.event = event
        message = f"{subject}: event {event!r} refused in state {state!r}: {detail}"
        MachineError.__init__(self, message)

    def __str__(self) -> str:
        return str(self.value)


class IllegalTransition(LifecycleError):
    """The event is not allowed at all in the subject's current state."""

    def __init__(self, lifecycle: str, subject: str, state: str, event: str) -> None:
        super().__init__(
            lifecycle, subject, state, event,
            f"the {lifecycle} lifecycle has no transition for this event from this state",
        )


class GuardRejected(LifecycleError):
    """The event is allowed in this state but a named guard is false.

    Attributes:
        guards: the names of the guards that rejected it (``"!name"`` for a guard that
            had to be false but was true).
    """

    def __init__(self, lifecycle: str, subject: str, state: str, event: str,
                 guards: tuple[str, ...]) -> None:
        self.guards = guards
        super().__init__(lifecycle, subject, state, event,
                         "guard " + " and ".join(repr(g) for g in guards) + " rejected it")


class InvariantViolation(KvtierError, AssertionError):
    """A lifecycle invariant does not hold.

    Attributes:
        invariant: the invariant's name from the spec (e.g. ``"conservation"``).
        subject: the node, request, pool or operation it failed for.
    """

    def __init__(self, invariant: str, subject: str, detail: str) -> None:
        self.invariant = invariant
        self.subject = subject
        super().__init__(f"invariant {invariant!r} violated by {subject}: {detail}")


class UnknownOperation(KvtierError, KeyError):
    """A completion named an op id the core never issued (a late or duplicate completion
    of a settled operation is absorbed, never refused), or ``poison`` named an operation
    that is not in flight."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown operation"


class DuplicateCompletion(KvtierError, ValueError):
    """The same (op, rank, layer) completion was delivered twice while the operation is in
    flight (once it has settled, a repeat is absorbed)."""


class CapacityError(KvtierError):
    """Not enough free pages to satisfy an all-or-nothing reservation.

    Attributes:
        pool: ``"device"`` or ``"host"``.
        group: the cache group that ran short.
        needed: pages asked for.
        free: pages free at the time.
    """

    def __init__(self, pool: str, group: str, needed: int, free: int) -> None:
        self.pool = pool
        self.group = group
        self.needed = needed
        self.free = free
        super().__init__(f"{pool} pool of cache group {group!r}: need {needed} pages, {free} free")
