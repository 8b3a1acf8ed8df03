"""Mooncake Store as the third tier (``mooncake://HOST:PORT``), through ``mooncake.store``.

The client is ``MooncakeDistributedStore`` from the ``mooncake-transfer-engine-non-cuda``
wheel (``mooncake-transfer-engine`` on CUDA machines), which needs Debian's ``libibverbs1``
even over TCP. It talks to a ``mooncake_master`` (metadata: where each object lives) and
moves bytes with Mooncake's transfer engine (TCP here, RDMA where the NICs have it). The
bytes live in *segments* that clients mount: each :class:`MooncakeStore` mounts one
(``segment_mb``), so every kvtier instance lends memory to the shared pool, and an object
lives in one instance's segment. The store drops objects on its own: eviction when the
segments are full (the master's ``-eviction_high_watermark_ratio``), and every object of a
segment whose client closed or died. Each object is ONE store entry, so the store can drop
an object but never half of one.

Calls (all batches, one round trip to the master each): ``batch_is_exist`` (exists; the
prefix length is counted here), ``batch_put_from`` and ``batch_get_into`` (zero-copy on the
Mooncake side: the transfer engine reads and writes a buffer registered once with
``register_buffer``), ``batch_remove``. Per-key codes are Mooncake's ``ErrorCode``
(``mooncake-store/include/types.h`` in the Mooncake repository): 0 ok, -200 no space
(store full until it evicts), -704 object not found, -705 already exists, -706 object has a
lease, -707 the lease expired during the transfer, -900 RPC failed (master unreachable).

Read leases: the master grants a lease on an object each time a client asks about it
(exists, get, a size query; Mooncake's ``ExistKey`` and ``GetReplicaList`` both grant one)
for ``-default_kv_lease_ttl`` (10 s unless set), and refuses to remove or evict it meanwhile
(-706). This backend keeps the expiry of every lease its own calls may have taken, on the
monotonic clock, from the moment the call returned (never earlier than the master's), and
never sends a remove for a key whose lease may still hold: :meth:`MooncakeStore.remove`
answers ``False`` for it (counted in ``lease_refusals``). A lease another client took is
unknown here: the master refuses that remove (-706), also ``False``. ``lease_s`` must be at
least the master's TTL (the URL's ``lease_s``, default 10).

Cost: a put copies each object (already packed by the driver) into the registered staging
buffer, and the transfer engine writes it into the owning segment (over TCP: through socket
buffers; over RDMA: the NIC reads the buffer, no CPU copy). A get runs the same backwards
and then copies the object out of the staging buffer. So 3 host-memory copies each way over
TCP (pack, staging, transport; as Redis), 2 over RDMA; ``copies`` records 3.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Sequence
from typing import Any, Protocol
from urllib.parse import parse_qsl, urlsplit

import numpy as np

from kvtier.fsm.errors import ConfigError

from .base import StoreError

__all__ = ["MooncakeStore", "MOONCAKE_INSTALL"]

MOONCAKE_INSTALL = ("pip install mooncake-transfer-engine-non-cuda (mooncake-transfer-engine on CUDA "
                    "machines) and apt-get install libibverbs1")

OK = 0
NO_SPACE = -200
BUFFER_TOO_SMALL = -600  # INVALID_PARAMS: the destination is smaller than the object
NOT_FOUND = -704
ALREADY_EXISTS = -705
HAS_LEASE = -706
RPC_FAIL = -900  # -900 and below: the master (or the HA layer) is unreachable


def _finite(value: float) -> bool:
    """``math.isfinite(value)``, and False for an int past a float's range (10**400); kept
    here because ``transfer/`` imports only the core's records and errors."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


class _Client(Protocol):
    """The part of ``mooncake.store.MooncakeDistributedStore`` used here (it ships no stubs;
    signatures checked against mooncake-transfer-engine-non-cuda 0.3.13.post1)."""

    def setup(self, local_hostname: str, metadata_server: str, global_segment_size: int,
              local_buffer_size: int, protocol: str, rdma_devices: str, master_server_addr: str) -> int: ...
    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...
    def unregister_buffer(self, buffer_ptr: int) -> int: ...
    def batch_is_exist(self, keys: list[str]) -> list[int]: ...
    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]: ...
    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]: ...
    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]: ...
    def get_size(self, key: str) -> int: ...
    def close(self) -> int: ...


def _new_client() -> _Client:
    try:
        from mooncake.store import (  # type: ignore[import-untyped, import-not-found, unused-ignore]
            MooncakeDistributedStore,
        )
    except ImportError as exc:
        raise ConfigError(f"the Mooncake Store backend needs the mooncake client: {MOONCAKE_INSTALL} "
                          f"({type(exc).__name__}: {exc})") from exc
    client: _Client = MooncakeDistributedStore()
    return client


class MooncakeStore:
    """A :class:`~kvtier.transfer.store.base.StoreBackend` on a Mooncake Store cluster.

    Args:
        host: the ``mooncake_master`` RPC host.
        port: the ``mooncake_master`` RPC port.
        lease_s: the master's read lease (``-default_kv_lease_ttl``) in seconds, or more.
        segment_mb: memory this client lends to the store (MiB; Mooncake's minimum is 16).
        buffer_mb: the registered staging buffer (MiB): a batch moves at most this many
            bytes per transfer call (larger batches are split); a larger object fails.
        protocol: ``tcp`` or ``rdma``; rdma_devices: RDMA NIC names (``rdma`` only).
        local_hostname: this client's address for the transfer engine.
        timeout_s: connect timeout for the reachability check before ``setup`` (Mooncake's
            own setup retries for about 90 s against a dead master).

    Raises:
        ConfigError: the client is not installed, or a bad argument.
        StoreError: the master cannot be reached or the client cannot be set up.
    """

    name = "mooncake"
    copies = 3

    def __init__(self, host: str = "127.0.0.1", port: int = 50051, *, lease_s: float = 10.0,
                 segment_mb: int = 64, buffer_mb: int = 64, protocol: str = "tcp", rdma_devices: str = "",
                 local_hostname: str = "127.0.0.1", timeout_s: float = 2.0) -> None:
        if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not _finite(lease_s) or lease_s < 0:
            raise ConfigError(f"mooncake lease_s must be a finite number of seconds >= 0, got {lease_s!r}")
        if isinstance(segment_mb, bool) or not isinstance(segment_mb, int) or segment_mb < 16:
            raise ConfigError(f"mooncake segment_mb must be an integer >= 16 (Mooncake's minimum), got {segment_mb!r}")
        if isinstance(buffer_mb, bool) or not isinstance(buffer_mb, int) or buffer_mb < 1:
            raise ConfigError(f"mooncake buffer_mb must be a positive integer, got {buffer_mb!r}")
        if protocol not in ("tcp", "rdma"):
            raise ConfigError(f"mooncake protocol must be 'tcp' or 'rdma', got {protocol!r}")
        self.lease_s = float(lease_s)
        self.address = f"{host}:{port}"
        self.lease_refusals = 0  # removes not sent because a lease of this client may hold
        self._leases: dict[str, float] = {}  # key -> monotonic time its lease surely ended
        self._prune_at = 1024
        self._slot = 0  # get slot: the largest object got so far (one layout: one size)
        client = _new_client()
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                pass
        except OSError as exc:
            raise StoreError(f"mooncake master {self.address} unreachable: {exc}") from exc
        rc = client.setup(local_hostname, "P2PHANDSHAKE", segment_mb << 20, 16 << 20, protocol, rdma_devices,
                          self.address)
        if rc != OK:
            client.close()
            raise StoreError(f"mooncake setup against {self.address} failed with code {rc}")
        self._client = client
        self._buf = np.zeros(buffer_mb << 20, dtype=np.uint8)
        self._ptr = int(self._buf.ctypes.data)
        rc = client.register_buffer(self._ptr, self._buf.nbytes)
        if rc != OK:
            client.close()
            raise StoreError(f"mooncake register_buffer ({buffer_mb} MiB) failed with code {rc}")
        self._closed = False

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = 2.0) -> MooncakeStore:
        """From ``mooncake://HOST:PORT[?lease_s=S&segment_mb=N&buffer_mb=N&protocol=tcp|rdma&rdma_devices=D]``.

        Raises:
            ConfigError: no host or port, an unknown or malformed parameter.
            StoreError: as the constructor.
        """
        p = urlsplit(url)
        if not p.hostname or not p.port:
            raise ConfigError(f"mooncake URL needs the master's host and port, like mooncake://127.0.0.1:50051, "
                              f"got {url!r}")
        kw: dict[str, Any] = {}
        kinds: dict[str, type] = {"lease_s": float, "segment_mb": int, "buffer_mb": int, "protocol": str,
                                  "rdma_devices": str, "local_hostname": str}
        for k, v in parse_qsl(p.query, keep_blank_values=True):
            if k not in kinds:
                raise ConfigError(f"unknown mooncake URL parameter {k!r} in {url!r}; expected one of {sorted(kinds)}")
            try:
                kw[k] = kinds[k](v)
            except ValueError:
                raise ConfigError(f"mooncake URL parameter {k}={v!r} is not a {kinds[k].__name__}") from None
        return cls(str(p.hostname), int(p.port), timeout_s=timeout_s, **kw)

    # -- leases ------------------------------------------------------------------------
    def _lease(self, keys: Sequence[str]) -> None:
        """Note that the master may have granted leases on ``keys`` up to now."""
        if self.lease_s <= 0:
            return
        until = time.monotonic() + self.lease_s
        for k in keys:
            self._leases[k] = until
        if len(self._leases) > self._prune_at:  # amortised: the table holds leases of the last lease_s
            now = time.monotonic()
            self._leases = {k: t for k, t in self._leases.items() if t > now}
            self._prune_at = max(1024, 2 * len(self._leases))

    def lease_holds(self, key: str) -> bool:
        """Whether a lease this client may have taken on ``key`` can still hold."""
        t = self._leases.get(key)
        return t is not None and t > time.monotonic()

    # -- the interface -------------------------------------------------------------------
    def _check_open(self) -> _Client:
        if self._closed:
            raise StoreError("mooncake store is closed")
        return self._client

    @staticmethod
    def _whole(what: str, codes: Sequence[int]) -> None:
        """Raise when every key failed with an RPC-level code (the master is unreachable)."""
        if codes and all(c <= RPC_FAIL for c in codes):
            raise StoreError(f"mooncake {what}: code {codes[0]} (RPC failed: master unreachable)")

    def exists_prefix(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        codes = list(self._check_open().batch_is_exist(list(keys)))
        self._lease([k for k, c in zip(keys, codes) if c != 0])  # present (or unknown): leased
        n = 0
        for c in codes:
            if c != 1:
                break
            n += 1
        if n == 0:
            self._whole("exists", codes[:1] if codes and codes[0] < 0 else [])
        return n

    def _batches(self, sizes: Sequence[int]) -> list[tuple[int, int]]:
        """Split items of ``sizes`` into runs [lo, hi) that fit the staging buffer."""
        runs: list[tuple[int, int]] = []
        lo, used = 0, 0
        for i, n in enumerate(sizes):
            if used + n > self._buf.nbytes and i > lo:
                runs.append((lo, i))
                lo, used = i, 0
            used += n
        if lo < len(sizes):
            runs.append((lo, len(sizes)))
        return runs

    def put(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        if not items:
            return []
        client = self._check_open()
        out: list[bool] = []
        codes_all: list[int] = []
        for lo, hi in self._batches([len(b) for _, b in items]):
            keys, ptrs, sizes = [], [], []
            off = 0
            for k, blob in items[lo:hi]:
                n = len(blob)
                if n > self._buf.nbytes:
                    continue  # larger than the staging buffer: not stored
                self._buf[off:off + n] = np.frombuffer(blob, dtype=np.uint8)
                keys.append(k)
                ptrs.append(self._ptr + off)
                sizes.append(n)
                off += n
            codes = dict(zip(keys, client.batch_put_from(keys, ptrs, sizes))) if keys else {}
            codes_all.extend(codes.values())
            # an existing key is the same content (keys hash the content's prefix): stored
            out.extend(codes.get(k, NO_SPACE) in (OK, ALREADY_EXISTS) for k, _ in items[lo:hi])
        self._lease([k for k, _ in items])  # a put may leave a lease too (Mooncake's PutEnd)
        if not any(out):
            self._whole("put", codes_all)
        return out

    def _learn_size(self, client: _Client, key: str) -> int:
        n = int(client.get_size(key))
        self._lease([key])
        return n

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        client = self._check_open()
        slot = self._slot or self._learn_size(client, keys[0])
        if slot <= 0 or slot > self._buf.nbytes:  # absent (or unreadable here): ask per batch anyway
            slot = min(self._buf.nbytes, max(slot, 1 << 16))
        per = max(1, self._buf.nbytes // slot)
        out: list[bytes | None] = []
        codes_all: list[int] = []
        for lo in range(0, len(keys), per):
            ks = list(keys[lo:lo + per])
            codes = client.batch_get_into(ks, [self._ptr + i * slot for i in range(len(ks))], [slot] * len(ks))
            self._lease(ks)
            codes_all.extend(codes)
            larger: list[int] = []
            for i, c in enumerate(codes):
                if c > 0:
                    out.append(self._buf[i * slot:i * slot + c].tobytes())
                    self._slot = max(self._slot, slot)
                else:
                    out.append(None)
                    if c == BUFFER_TOO_SMALL:
                        larger.append(lo + i)
            for j in larger:  # a larger object than the slot: fetch it alone (the slots are read)
                out[j] = self._get_one(client, keys[j])
        if all(b is None for b in out):
            self._whole("get", codes_all)
        return out

    def _get_one(self, client: _Client, key: str) -> bytes | None:
        n = self._learn_size(client, key)
        if n <= 0 or n > self._buf.nbytes:
            return None
        [c] = client.batch_get_into([key], [self._ptr], [n])
        self._lease([key])
        if c <= 0:
            return None
        self._slot = max(self._slot, n)  # the largest object seen: later batches fit it
        return self._buf[:c].tobytes()

    def remove(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        client = self._check_open()
        free = [k for k in keys if not self.lease_holds(k)]
        self.lease_refusals += len(keys) - len(free)
        codes = dict(zip(free, client.batch_remove(free, False))) if free else {}
        self._whole("remove", list(codes.values()))
        for k in free:
            self._leases.pop(k, None)
        # gone: removed or already absent; a lease (-706, another client's) keeps it
        return [codes.get(k, HAS_LEASE) in (OK, NOT_FOUND) for k in keys]

    def close(self) -> None:
        """Unregister the staging buffer and close the client (its segment's objects are
        dropped by the store)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._client.unregister_buffer(self._ptr)
        finally:
            self._client.close()
