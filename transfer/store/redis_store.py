"""Redis as the third tier (``redis://HOST:PORT[/DB]``), through the ``redis`` client.

Each object is ONE Redis string (``SET key blob``), so Redis can evict an object but never
half of one (a torn object, stored as several keys, is the case LMCache's Redis connector
has to handle). Batches go in one pipeline round trip: ``EXISTS`` per key for exists (the
prefix length is counted on the client), ``SET`` for put, ``MGET`` for get, ``DEL`` for
remove. Redis grants no read lease (``lease_s`` 0).

Cost: Redis copies. A put packs the host pages into a bytes object (one copy), the client
writes it to the socket (kernel buffer: a second), the server stores it (a third, in the
server's memory); a get runs the same in reverse and then writes into the host pages. So
about 3 host-memory copies of every byte each way plus loopback TCP, against a zero-copy
store that reads registered host memory directly (Mooncake Store). ``copies`` records 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from kvtier.fsm.errors import ConfigError

from .base import StoreError

__all__ = ["RedisStore"]


class RedisStore:
    """A :class:`~kvtier.transfer.store.base.StoreBackend` on one Redis server.

    Args:
        host: the server's host.
        port: the server's port.
        db: the Redis database number.
        timeout_s: socket connect and read timeout (a hung server fails the call).
        prefix: prepended to every key (kvtier's objects share a server with other data).

    Raises:
        ConfigError: the ``redis`` package is not installed.
    """

    name = "redis"
    lease_s = 0.0
    copies = 3

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, db: int = 0, *, timeout_s: float = 2.0,
                 prefix: str = "kvtier:") -> None:
        try:
            import redis  # type: ignore[import-untyped, import-not-found, unused-ignore]
        except ImportError as exc:  # pragma: no cover - the extra is installed in CI
            raise ConfigError("the Redis store needs the redis client: pip install 'kvtier[l3]'") from exc
        self._redis_errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self.prefix = prefix
        self.client: Any = redis.Redis(host=host, port=port, db=db, socket_timeout=timeout_s,
                                       socket_connect_timeout=timeout_s)

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 2.0) -> RedisStore:
        """From ``redis://HOST:PORT[/DB]``.

        Raises:
            ConfigError: no host or port, or a bad database number.
        """
        p = urlsplit(url)
        if not p.hostname or not p.port:
            raise ConfigError(f"redis URL needs a host and a port, like redis://127.0.0.1:6379, got {url!r}")
        path = p.path.strip("/")
        if path and not path.isdigit():
            raise ConfigError(f"redis URL database must be a number, got {path!r} in {url!r}")
        return cls(str(p.hostname), int(p.port), int(path or 0), timeout_s=timeout_s)

    def _k(self, key: str) -> str:
        return self.prefix + key

    def _call(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except self._redis_errors as exc:
            raise StoreError(f"redis {what}: {type(exc).__name__}: {exc}") from exc

    def exists_prefix(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0

        def run() -> list[int]:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._k(k))
            return list(pipe.execute())

        n = 0
        for v in self._call("exists", run):
            if not v:
                break
            n += 1
        return n

    def put(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        if not items:
            return []

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for k, blob in items:
                pipe.set(self._k(k), blob)
            return list(pipe.execute(raise_on_error=False))

        return [v is True for v in self._call("put", run)]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        got = self._call("get", lambda: self.client.mget([self._k(k) for k in keys]))
        return [bytes(v) if v is not None else None for v in got]

    def remove(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        self._call("remove", lambda: self.client.delete(*[self._k(k) for k in keys]))
        return [True] * len(keys)

    def close(self) -> None:
        try:
            self.client.close()
        except self._redis_errors:  # pragma: no cover - closing a dead connection
            pass
