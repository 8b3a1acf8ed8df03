"""kvtier: a two-tier (GPU device L1, pinned host L2) KV cache with radix-tree prefix
reuse, whose lifecycle is an explicit, verified state machine.

An engine embeds :class:`TieredCache` and drives it with the records exported here: its
options (:class:`WritePolicy`, :class:`L3Options`; :class:`MatchMode` for
``cache.core.match``), what it passes in (:class:`ForwardResult`, :class:`Reservation`,
:class:`Completion`), what it gets back (:class:`Admission`, :class:`PollResult` with its
:class:`TransferCommand` and :class:`RequestEvent` records, :class:`StepOutcome` of
:class:`ItemOutcome` records, :class:`RequestView`, :class:`Outstanding`), and the errors it
may catch (:class:`KvtierError` and its subclasses).

``import kvtier`` loads neither torch nor numba: the transfer engine
(``kvtier.transfer``) is imported only when used.
"""

from __future__ import annotations

from . import _moved

_moved.install()

from kvtier.fsm import (
    CacheGroupSpec,
    CapacityError,
    ComponentSpec,
    Completion,
    ConfigError,
    Direction,
    DuplicateCompletion,
    Family,
    GroupTransfer,
    GuardRejected,
    IllegalTransition,
    InvariantViolation,
    KvtierError,
    LifecycleError,
    MatchMode,
    SpecNameError,
    TransferCommand,
    UnknownOperation,
    UsageError,
)
from .tiered import (
    Admission,
    ForwardResult,
    ItemOutcome,
    L3Options,
    Outstanding,
    PollResult,
    RequestEvent,
    RequestView,
    Reservation,
    StepOutcome,
    TieredCache,
    WritePolicy,
)

__version__ = "0.1.0"

__all__ = [
    "Admission",
    "CacheGroupSpec",
    "CapacityError",
    "ComponentSpec",
    "Completion",
    "ConfigError",
    "Direction",
    "DuplicateCompletion",
    "Family",
    "ForwardResult",
    "GroupTransfer",
    "GuardRejected",
    "IllegalTransition",
    "InvariantViolation",
    "ItemOutcome",
    "KvtierError",
    "L3Options",
    "LifecycleError",
    "MatchMode",
    "Outstanding",
    "PollResult",
    "RequestEvent",
    "RequestView",
    "Reservation",
    "SpecNameError",
    "StepOutcome",
    "TieredCache",
    "TransferCommand",
    "UnknownOperation",
    "UsageError",
    "WritePolicy",
    "__version__",
]
