"""The L3 machine's store side: a faulty shared store behind the real store driver.

Each instance of :class:`~kvtier.testing.l3_machine.L3TierMachine` answers its store
commands through its own :class:`~kvtier.transfer.store.StoreDriver` (run synchronously on
the machine's thread: the driver's own ``submit``, ``_run`` and ``poll``), over a real
:class:`~kvtier.transfer.store.HostPageIO` on numpy host regions, against
:class:`FakeStore`, one backend shared by both instances. So the driver's get path (the
delivered prefix ends at the first missing or corrupt object, checked objects are written
into their own pages, a cancelled operation writes nothing) and the object format run
exactly as an engine runs them.

- :class:`HostBytes`: an instance's host content model (page -> content value) whose every
  write also writes a byte pattern of the value into the host regions; after a get, the
  pages it reserved are read back from the regions (:meth:`HostBytes.read_back`), so what the
  driver wrote, where, is what the content model sees.
- :class:`FakeStore`: whole objects by key, a read lease on every object a get asks for
  (``lease_s`` of the instance that asked; a remove of a leased object is refused, as a
  store with leases does), and the faults a command is answered with: fail it as a whole
  (the backend raises an error of the kind asked), drop the first object
  (a miss), tear it (a corrupt object), a gap (a middle object missing), or a prefix only
  (the last object missing).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.fsm import CacheCore
from kvtier.fsm.records import StoreCommand, StoreResult
from kvtier.transfer.store import HostPageIO, StoreDriver

__all__ = ["FakeStore", "HostBytes", "sync_driver", "run_command", "WIDTH"]

#: bytes per host page and region in the machine's host mirror (a small fixed width: the
#: object format only needs the same width on every instance)
WIDTH = 16


def _pattern(value: Any, comp: str, layer: int) -> bytes:
    return hashlib.sha256(repr((value, comp, layer)).encode()).digest()[:WIDTH]


class HostBytes(dict[tuple[str, int], Any]):
    """Host page (group, page) -> content value; writes mirror into the host regions.

    Args:
        core: the instance's core (its layout and host capacity).
        table: pattern -> (value, component, layer), shared by every instance (decoding).
    """

    def __init__(self, core: CacheCore, table: dict[bytes, tuple[Any, str, int]]) -> None:
        super().__init__()
        self.table = table
        self.plan = [(g.name, c.name, layer) for g in core.layout.history_groups for c in g.components
                     for layer in g.layers]
        host = core.host or {}
        self.regions = {(g, c, layer): np.zeros((host[g].capacity, WIDTH), dtype=np.uint8)
                        for g, c, layer in self.plan}
        self.layout = core.layout
        self.io = HostPageIO(core.layout, self.regions)

    def encode(self, value: Any, comp: str, layer: int) -> np.ndarray:
        pat = _pattern(value, comp, layer)
        self.table[pat] = (value, comp, layer)
        return np.frombuffer(pat, dtype=np.uint8)

    def __setitem__(self, key: tuple[str, int], value: Any) -> None:
        g, p = key
        for group, comp, layer in self.plan:
            if group == g:
                self.regions[(g, comp, layer)][p] = self.encode(value, comp, layer)
        super().__setitem__(key, value)

    def decode(self, g: str, p: int) -> Any:
        """The value the regions hold for host page ``p`` of ``g`` (every component and
        layer must agree; else a garbage value naming the page)."""
        seen = set()
        for group, comp, layer in self.plan:
            if group == g:
                got = self.table.get(bytes(self.regions[(g, comp, layer)][p]))
                if got is None or got[1:] != (comp, layer):
                    return ("garbage", "host bytes", g, p)
                seen.add(repr(got[0]))
                value = got[0]
        return value if len(seen) == 1 else ("garbage", "torn host page", g, p)

    def read_back(self, pages: Sequence[dict[str, list[int]]]) -> None:
        """Take the values of ``pages`` (a get's reserved pages) from the regions."""
        for pm in pages:
            for g, ps in pm.items():
                for p in ps:
                    dict.__setitem__(self, (g, p), self.decode(g, p))

    def blob(self, key: str, values: dict[str, list[Any]]) -> bytes:
        """The object another engine would put for ``key`` holding ``values`` (group ->
        the unit's page values), in this instance's object format."""
        scratch = {(g, c, layer): np.zeros((len(values[g]), WIDTH), dtype=np.uint8) for g, c, layer in self.plan}
        for (g, comp, layer), r in scratch.items():
            for j, v in enumerate(values[g]):
                r[j] = self.encode(v, comp, layer)
        return HostPageIO(self.layout, scratch).pack(key, {g: list(range(len(vs))) for g, vs in values.items()})


class FakeStore:
    """The shared store (module doc). ``objects`` maps key -> object bytes; ``leases`` key
    -> the time its read lease ends; ``now`` is the machine's clock, set before each call."""

    name = "fake"
    copies = 1

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.leases: dict[str, float] = {}
        self.now = 0.0
        self.lease_s = 0.0  # of the instance whose command runs
        self.fault: str | None = None
        self.error_kind = "StoreError"  # with fault "error": the kind of error the backend raises

    def _fail(self) -> None:
        if self.fault == "error":  # the driver reports "<kind>: <message>"
            raise type(self.error_kind, (Exception,), {})("the fake store failed the operation")

    # -- the backend interface (the driver's thread: here the machine's) -------------------
    def exists_prefix(self, keys: Sequence[str]) -> int:
        self._fail()
        n = 0
        for k in keys:
            if k not in self.objects:
                break
            n += 1
        return n - 1 if self.fault == "partial" and n else n

    def put(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        self._fail()
        oks = []
        for j, (k, b) in enumerate(items):
            if self.fault == "partial" and j == len(items) - 1:
                oks.append(False)
                continue
            self.objects[k] = b
            oks.append(True)
        return oks

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        self._fail()
        if keys and self.fault == "drop":
            self.objects.pop(keys[0], None)
        if keys and self.fault == "torn" and keys[0] in self.objects:
            self.objects[keys[0]] = torn(self.objects[keys[0]])
        out: list[bytes | None] = []
        for j, k in enumerate(keys):
            gap = self.fault == "gap" and len(keys) > 1 and j == len(keys) // 2
            last = self.fault == "partial" and j == len(keys) - 1
            out.append(None if gap or last else self.objects.get(k))
            if self.lease_s > 0 and k in self.objects:  # a read leases what it asked for
                self.leases[k] = max(self.leases.get(k, 0.0), self.now + self.lease_s)
        return out

    def remove(self, keys: Sequence[str]) -> list[bool]:
        self._fail()
        oks = []
        for j, k in enumerate(keys):
            if (self.fault == "partial" and j == len(keys) - 1) or self.leases.get(k, 0.0) > self.now:
                oks.append(False)  # a failed remove, or one refused under a read lease
                continue
            self.objects.pop(k, None)
            oks.append(True)
        return oks

    def close(self) -> None:
        pass


def torn(blob: bytes) -> bytes:
    """``blob`` with its payload digest overwritten (a torn or overwritten object; tearing
    it again leaves it torn)."""
    return blob[:32] + b"TORNTORN" + blob[40:]


def sync_driver(store: FakeStore, io: HostPageIO) -> StoreDriver:
    """A store driver whose thread has stopped: :func:`run_command` runs its loop on the
    caller's thread, one command at a time."""
    drv = StoreDriver(store, io)
    drv._todo.put(None)
    drv._thread.join()
    return drv


def run_command(drv: StoreDriver, cmd: StoreCommand) -> StoreResult:
    """Run ``cmd`` through ``drv`` as its thread would (submit, the driver loop, poll)."""
    drv.submit([cmd])
    drv._todo.put(None)
    drv._run()
    out = drv.poll()
    assert len(out) == 1 and out[0].op_id == cmd.op_id, out
    return out[0]
