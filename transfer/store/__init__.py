"""Host <-> store transfers for the L3 tier (:mod:`kvtier.fsm.l3`).

- :mod:`.base`: the store-backend interface (:class:`StoreBackend`: batch exists returning
  the prefix length present, batch put, batch get, remove, per-key results).
- :mod:`.hostio`: packs one object (every history group's host pages of one cache unit)
  into one checked byte string and unpacks it into host pages.
- :mod:`.driver`: :class:`StoreDriver` runs a backend's operations on its own thread;
  results enter the core only through :meth:`StoreDriver.poll` on the scheduler's thread.
- :mod:`.redis_store`: Redis (``redis://HOST:PORT``), one key per object.
- :mod:`.mooncake_store`: Mooncake Store (``mooncake://HOST:PORT``, the master), one entry per
  object, read leases honoured.
- :func:`open_store`: a backend from a URL.
"""

from .base import StoreBackend, StoreError, open_store
from .driver import StoreDriver
from .hostio import HostPageIO, ObjectError

__all__ = ["StoreBackend", "StoreError", "open_store", "StoreDriver", "HostPageIO", "ObjectError"]
