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
from kvtier.fsm.errors import ConfigError, UsageError
from kvtier.transfer.store import HostPageIO, StoreDriver, StoreError

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


@pytest.mark.parametrize("bad", [[None], [{"op_id": 1}], [_get(1), "get"], _get(1), None, "cmds"],
                         ids=["None", "dict", "str-after-a-command", "one-command", "no-list", "str"])
def test_submit_refuses_anything_but_a_list_of_store_commands_and_queues_nothing(
        rig: tuple[HeldStore, StoreDriver, np.ndarray, HostPageIO], bad: object) -> None:
    """A None in the list stopped the driver's thread (None is its stop sentinel) and any
    other object killed it (AttributeError on the thread): every later operation was never
    answered. submit refuses it with a UsageError naming it, queues none of the list, and
    the driver goes on answering."""
    store, driver, region, _ = rig
    store.answer()
    with pytest.raises(UsageError) as e:
        driver.submit(bad)  # type: ignore[arg-type]
    assert type(e.value) is UsageError and "store driver submit: " in str(e.value)
    driver.submit([_get(7)])
    [res] = _results(driver, 1).values()
    assert (res.op_id, res.ok) == (7, (True, True)) and store.calls == [("get", KEYS)]


def test_submit_after_close_is_refused_and_close_twice_closes_the_backend_once(
        rig: tuple[HeldStore, StoreDriver, np.ndarray, HostPageIO]) -> None:
    """After close the driver's thread is gone: a command submitted then was queued and never
    answered. It raises StoreError; a second close does nothing."""
    store, driver, _, _ = rig
    closes: list[int] = []
    store.close = lambda: closes.append(1)  # type: ignore[method-assign]
    store.answer()
    driver.close(WAIT_S)
    with pytest.raises(StoreError, match="store driver is closed"):
        driver.submit([_get(1)])
    driver.close(WAIT_S)
    assert closes == [1] and driver.poll() == []


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, None, "8"], ids=repr)
def test_max_queued_must_be_an_int_of_at_least_1(bad: object) -> None:
    """max_queued bounds the commands queued: 0 or -1 failed every operation at once, None
    raised TypeError at the first submit; each is a ConfigError naming the value."""
    io = HostPageIO(LAYOUT, {("g", "kv", 0): np.zeros((4, 16), np.uint8)})
    with pytest.raises(ConfigError) as e:
        StoreDriver(HeldStore(), io, max_queued=bad)  # type: ignore[arg-type]
    assert str(e.value) == f"store driver: max_queued must be an int >= 1, got {bad!r}"
