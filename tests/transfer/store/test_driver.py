"""The store driver (kvtier.transfer.store.driver) against an in-memory backend that holds each
call until the test lets it answer: a get cancelled while the store answers writes nothing into
the host pages it no longer owns and reports ``cancelled``; a put or get cancelled before it
runs touches no host page and a put sends nothing; a get not cancelled fills its pages."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from kvtier.fsm.layout import CacheLayout
from kvtier.fsm.records import CacheGroupSpec, ComponentSpec, Family, StoreCommand, StoreOp, StoreResult
from kvtier.transfer.store import HostPageIO, StoreDriver

WAIT_S = 30.0  # a bound on each wait, never reached when the driver is right


class HeldStore:
    """A dict store whose get and put wait for :meth:`answer` (the driver's thread blocks in
    the call, as on a slow server) after they set ``entered``."""

    name = "held"
    lease_s = 0.0
    copies = 1

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.entered = threading.Event()
        self._go = threading.Event()

    def answer(self) -> None:
        self._go.set()

    def _hold(self, what: str, keys: Sequence[str]) -> None:
        self.calls.append((what, tuple(keys)))
        self.entered.set()
        assert self._go.wait(WAIT_S), "the test never let the store answer"

    def exists_prefix(self, keys: Sequence[str]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.objects:
            n += 1
        return n

    def put(self, items: Sequence[tuple[str, bytes]]) -> list[bool]:
        self._hold("put", [k for k, _ in items])
        self.objects.update(items)
        return [True] * len(items)

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        self._hold("get", keys)
        return [self.objects.get(k) for k in keys]

    def remove(self, keys: Sequence[str]) -> list[bool]:
        for k in keys:
            self.objects.pop(k, None)
        return [True] * len(keys)

    def close(self) -> None:
        self._go.set()


LAYOUT = CacheLayout("t", (CacheGroupSpec("g", Family.HISTORY, 4, 1, (0,), (ComponentSpec("kv", 16),)),), 1)
KEYS = ("aa" * 16, "bb" * 16)


@pytest.fixture
def rig() -> Iterator[tuple[HeldStore, StoreDriver, np.ndarray, HostPageIO]]:
    region = np.zeros((4, 16), np.uint8)
    io = HostPageIO(LAYOUT, {("g", "kv", 0): region})
    store = HeldStore()
    region[0], region[1] = 7, 9
    store.objects = {k: io.pack(k, {"g": [p]}) for k, p in zip(KEYS, (0, 1))}
    region[:] = 0
    driver = StoreDriver(store, io)
    yield store, driver, region, io
    store.answer()
    driver.close(WAIT_S)


def _get(op_id: int) -> StoreCommand:
    return StoreCommand(op_id, StoreOp.GET, KEYS, ({"g": [2]}, {"g": [3]}), 0.0)


def _results(driver: StoreDriver, n: int) -> dict[int, StoreResult]:
    """The next ``n`` results, by op id."""
    out: dict[int, StoreResult] = {}
    while len(out) < n:
        assert driver.wait(WAIT_S), f"{len(out)} of {n} results from the driver"
        out.update((r.op_id, r) for r in driver.poll())
    return out


def test_a_get_fills_its_host_pages_with_the_objects_in_order(rig: tuple[HeldStore, StoreDriver, np.ndarray, HostPageIO]) -> None:
    store, driver, region, _ = rig
    store.answer()
    driver.submit([_get(1)])
    [res] = _results(driver, 1).values()
    assert (res.op_id, res.ok, res.error, res.corrupt) == (1, (True, True), None, ())
    assert res.nbytes == sum(len(store.objects[k]) for k in KEYS)
    assert region[2].tolist() == [7] * 16 and region[3].tolist() == [9] * 16
    assert region[:2].sum() == 0


def test_a_get_cancelled_while_the_store_answers_writes_nothing_and_reports_cancelled(rig: tuple[HeldStore, StoreDriver, np.ndarray, HostPageIO]) -> None:
    store, driver, region, _ = rig
    driver.submit([_get(1)])
    assert store.entered.wait(WAIT_S)
    driver.cancel(1)  # its deadline passed: the tier lets its pages go
    store.answer()
    [res] = _results(driver, 1).values()
    assert (res.op_id, res.error, res.ok) == (1, "cancelled", ())
    assert region.sum() == 0


def test_a_command_cancelled_before_it_runs_never_touches_its_pages(rig: tuple[HeldStore, StoreDriver, np.ndarray, HostPageIO]) -> None:
    store, driver, region, io = rig
    region[2] = 5
    driver.cancel(1)
    driver.cancel(2)
    driver.submit([StoreCommand(1, StoreOp.PUT, ("cc" * 16,), ({"g": [2]},), 0.0), _get(2)])
    store.answer()
    got = _results(driver, 2)
    assert {i: (r.error, r.ok) for i, r in got.items()} == {1: ("cancelled", ()), 2: ("cancelled", ())}
    assert "cc" * 16 not in store.objects and ("put", ("cc" * 16,)) not in store.calls
    assert region[2].tolist() == [5] * 16 and region[3].sum() == 0
