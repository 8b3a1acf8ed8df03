"""The store-backend interface: what a store must offer to be kvtier's third tier.

A backend is a small synchronous object used from one thread (the
:class:`~kvtier.transfer.store.driver.StoreDriver`'s): every call is a batch, answers per
key, and raises :class:`StoreError` (or any ``OSError``) when the store cannot be reached;
the driver turns that into a failed operation. Values are whole objects (bytes): a
backend stores each in ONE store entry, so the store can drop an object but never tear it.
Each backend is a module of :mod:`kvtier.transfer.store` (whose ``open_store`` picks one by
URL scheme); a backend imports this interface, never that registry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvtier.fsm.errors import KvtierError

__all__ = ["StoreBackend", "StoreError"]


class StoreError(KvtierError):
    """The store failed an operation as a whole (unreachable, refused, timed out)."""


@runtime_checkable
class StoreBackend(Protocol):
    """A key-value store for whole objects.

    Attributes:
        name: ``redis`` or ``mooncake`` (for reports).
        lease_s: the read lease a get (Mooncake: any question about the object, exists
            too) leaves on an object (seconds; 0 if none): the store refuses to remove it
            meanwhile. Give it to the tier: ``L3Options(lease_s=backend.lease_s)``.
        copies: how many times a byte is copied in host memory on the way to or from the
            store (documented cost; Redis: serialise + socket buffers).
    """

    name: str
    lease_s: float
    copies: int

    def exists_prefix(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first on, the store holds."""
        ...

    def put(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        """Store every (key, object); per key, whether it was stored."""
        ...

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """The objects of ``keys`` (``None`` where the store has none)."""
        ...

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Remove ``keys``; per key, whether it is gone (removed or already absent).
        A key under a read lease is not removed (``False``)."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...
