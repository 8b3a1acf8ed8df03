"""kvtier's verified core: the lifecycle state machines and the tiered radix prefix cache
(:class:`CacheCore`).

Pure Python and sans-I/O: it never imports torch or numba, never waits and never copies
bytes. It turns scheduler calls into lifecycle triggers and returns
:class:`TransferCommand` records; it takes :class:`Completion` records back as events.
"""

from .errors import (
    CapacityError,
    ConfigError,
    DuplicateCompletion,
    GuardRejected,
    IllegalTransition,
    InvariantViolation,
    KvtierError,
    LifecycleError,
    SpecNameError,
    UnknownOperation,
    UsageError,
)
from .node.core import CacheCore
from .node.ledger import units_to_pages
from .node.match import MatchMode, MatchResult
from .node.results import CacheStats, InsertResult, LoadResult
from .node.writeback import WritePolicy
from .records import CacheGroupSpec, ComponentSpec, Completion, Direction, Family, GroupTransfer, TransferCommand

__all__ = [
    "CacheCore",
    "CacheStats",
    "InsertResult",
    "LoadResult",
    "MatchMode",
    "MatchResult",
    "WritePolicy",
    "units_to_pages",
    "CacheGroupSpec",
    "CapacityError",
    "ComponentSpec",
    "Completion",
    "ConfigError",
    "Direction",
    "DuplicateCompletion",
    "Family",
    "GroupTransfer",
    "GuardRejected",
    "IllegalTransition",
    "InvariantViolation",
    "KvtierError",
    "LifecycleError",
    "SpecNameError",
    "TransferCommand",
    "UnknownOperation",
    "UsageError",
]
