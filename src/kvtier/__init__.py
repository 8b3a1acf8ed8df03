"""kvtier: a two-tier (GPU device L1, pinned host L2) KV cache with radix-tree prefix
reuse, whose lifecycle is an explicit, verified state machine.

``import kvtier`` loads neither torch nor numba: the transfer engine
(``kvtier.transfer``) is imported only when used.
"""

from __future__ import annotations

from . import _moved

_moved.install()

from kvtier.fsm import (
    CacheGroupSpec,
    ComponentSpec,
    Completion,
    ConfigError,
    Direction,
    Family,
    GroupTransfer,
    GuardRejected,
    IllegalTransition,
    KvtierError,
    TransferCommand,
)
from .tiered import TieredCache

__version__ = "0.1.0"

__all__ = [
    "CacheGroupSpec",
    "ComponentSpec",
    "Completion",
    "ConfigError",
    "Direction",
    "Family",
    "GroupTransfer",
    "GuardRejected",
    "IllegalTransition",
    "KvtierError",
    "TieredCache",
    "TransferCommand",
    "__version__",
]
