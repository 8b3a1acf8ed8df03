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
- :func:`open_store` (here, the registry): a backend from a URL; it imports the backend's
  module only when that backend is opened, and no backend imports it.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from kvtier.fsm.errors import ConfigError

from .base import StoreBackend, StoreError
from .driver import StoreDriver
from .hostio import HostPageIO, ObjectError

__all__ = ["StoreBackend", "StoreError", "open_store", "StoreDriver", "HostPageIO", "ObjectError"]


def open_store(url: str, *, timeout_s: float = 2.0) -> StoreBackend:
    """A backend for ``url``: ``redis://HOST:PORT[/DB]`` (:class:`~.redis_store.RedisStore`) or
    ``mooncake://HOST:PORT[?lease_s=S&segment_mb=N&buffer_mb=N&protocol=tcp|rdma]`` (the
    ``mooncake_master`` RPC address; :class:`~.mooncake_store.MooncakeStore`).

    Raises:
        ConfigError: an unknown scheme, a malformed URL, or a backend whose client is not
            installed (Redis: ``pip install 'kvtier[l3]'``; Mooncake: ``pip install
            mooncake-transfer-engine-non-cuda`` and ``apt-get install libibverbs1``).
        StoreError: a Mooncake master that cannot be reached (the client connects at once).
    """
    if not isinstance(url, str):
        raise ConfigError(f"store URL must be a string like redis://127.0.0.1:6379, got {url!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - parsing the port raises for one out of range or not a number
    except ValueError as exc:
        raise ConfigError(f"malformed store URL {url!r} ({exc}); expected e.g. redis://127.0.0.1:6379") from None
    if parts.scheme == "redis":
        from .redis_store import RedisStore

        return RedisStore.from_url(url, timeout_s=timeout_s)
    if parts.scheme == "mooncake":
        from .mooncake_store import MooncakeStore

        return MooncakeStore.from_url(url, timeout_s=timeout_s)
    raise ConfigError(f"unknown store URL scheme {parts.scheme!r} in {url!r}; expected redis:// or mooncake://")
