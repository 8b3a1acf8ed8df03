"""Errors raised by the transfer engine.

All subclass :class:`kvtier.fsm.KvtierError`; errors about bad input also subclass
:class:`kvtier.fsm.ConfigError` (and so :class:`ValueError`).
"""

from __future__ import annotations

from kvtier.fsm import ConfigError, KvtierError

__all__ = [
    "TransferError",
    "HostMemoryError",
    "BackendUnavailable",
    "HazardError",
    "PoisonedReadError",
    "NotReadyError",
]


class TransferError(KvtierError):
    """Base class of the transfer engine's own runtime errors."""


class HostMemoryError(ConfigError):
    """A host pool does not fit into the host memory that is available.

    Attributes:
        needed: bytes the pool needs.
        available: bytes available (``MemAvailable``) minus the reserve.
    """

    def __init__(self, needed: int, available: int, detail: str) -> None:
        self.needed = needed
        self.available = available
        super().__init__(detail)


class BackendUnavailable(ConfigError):
    """The backend asked for cannot run on this machine or with these pools."""


class HazardError(TransferError):
    """Fake-asynchronous mode: a copy or an access touches a page that a pending copy
    on another stream still reads or writes (a real GPU would race)."""


class PoisonedReadError(HazardError):
    """Fake-asynchronous mode: a destination page was read before the copy that
    writes it completed (it still holds the poison pattern)."""


class NotReadyError(TransferError):
    """Fake-asynchronous mode: :meth:`TransferEngine.wait_layer` was called for a layer
    whose chunk has not completed (a real stream would wait; the fake one cannot)."""
