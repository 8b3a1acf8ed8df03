"""One L3 object as bytes: every history group's host pages of one cache unit.

Layout of an object: a 40-byte header (magic ``KVT3``, 4 bytes format version, the
16-byte key digest, the payload length as 8 bytes little-endian, the payload's 8-byte
BLAKE2b digest), then the payload: for each history group in layout order, each
component, each layer of the group, the unit's pages (``pages_per_unit x page_bytes``).
A get checks the header against the key it asked for, the length against the layout
and the digest against the payload before a byte reaches a host page, so a torn,
truncated, stale or foreign object is reported as corrupt, never read.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvtier.fsm.errors import KvtierError

__all__ = ["HostPageIO", "ObjectError"]

_MAGIC = b"KVT3"
_HEADER = struct.Struct("<4sI16sQ8s")


class ObjectError(KvtierError):
    """An object failed its check (wrong key, length or digest)."""


class HostPageIO:
    """Reads and writes objects from and to a host pool's pages.

    Args:
        layout: the layout the pool holds (history groups only are moved).
        regions: ``(group, component, layer) -> uint8 array [pages, page_bytes]``: the host
            pool's regions (numpy views; e.g. :meth:`from_pool`).

    Raises:
        KvtierError: a region missing for a history group's component and layer.
    """

    def __init__(self, layout: Any, regions: Mapping[tuple[str, str, int], np.ndarray]) -> None:
        self._plan: list[tuple[str, np.ndarray]] = []
        self.object_bytes = 0
        for g in layout.history_groups:
            for c in g.components:
                for layer in g.layers:
                    r = regions.get((g.name, c.name, layer))
                    if r is None:
                        raise KvtierError(f"host io: no host region for {g.name}/{c.name} layer {layer}")
                    self._plan.append((g.name, r))
                    self.object_bytes += layout.pages_per_unit(g) * r.shape[1]
        self.version = 1

    @classmethod
    def from_pool(cls, layout: Any, pool: object) -> HostPageIO:
        """From a :class:`kvtier.transfer.HostPool` (CPU tensors viewed as numpy arrays)."""
        regions = {}
        for g in layout.history_groups:
            for c in g.components:
                for layer in g.layers:
                    t = pool.region(g.name, c.name, layer)  # type: ignore[attr-defined]
                    regions[(g.name, c.name, layer)] = t.numpy()
        return cls(layout, regions)

    def pack(self, key: str, pages: Mapping[str, Sequence[int]]) -> bytes:
        """The object for ``key`` from host ``pages`` (group -> the unit's page ids)."""
        parts = [r[np.asarray(pages[g], dtype=np.int64)].tobytes() for g, r in self._plan]
        payload = b"".join(parts)
        digest = hashlib.blake2b(payload, digest_size=8).digest()
        return _HEADER.pack(_MAGIC, self.version, bytes.fromhex(key), len(payload), digest) + payload

    def check(self, key: str, blob: bytes) -> memoryview:
        """The payload of ``blob`` after checking it is ``key``'s object.

        Raises:
            ObjectError: naming what does not match.
        """
        if len(blob) < _HEADER.size:
            raise ObjectError(f"object {key[:12]}: {len(blob)} bytes, shorter than its header")
        magic, version, kd, n, digest = _HEADER.unpack_from(blob)
        if magic != _MAGIC or version != self.version:
            raise ObjectError(f"object {key[:12]}: not a kvtier object (magic {magic!r}, version {version})")
        if kd != bytes.fromhex(key):
            raise ObjectError(f"object {key[:12]}: holds key {kd.hex()[:12]}")
        payload = memoryview(blob)[_HEADER.size:]
        if n != len(payload) or n != self.object_bytes:
            raise ObjectError(f"object {key[:12]}: payload {len(payload)} bytes, header {n}, layout "
                              f"{self.object_bytes}")
        if hashlib.blake2b(payload, digest_size=8).digest() != digest:
            raise ObjectError(f"object {key[:12]}: payload digest mismatch (torn or overwritten)")
        return payload

    def unpack(self, payload: memoryview, pages: Mapping[str, Sequence[int]]) -> None:
        """Write a checked payload into host ``pages`` (group -> the unit's page ids)."""
        off = 0
        for g, r in self._plan:
            idx = np.asarray(pages[g], dtype=np.int64)
            n = len(idx) * r.shape[1]
            r[idx] = np.frombuffer(payload[off:off + n], dtype=np.uint8).reshape(len(idx), r.shape[1])
            off += n
