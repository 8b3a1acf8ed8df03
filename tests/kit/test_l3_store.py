"""The L3 machine's store side (kvtier.testing.l3_store): the real store driver, run on the
caller's thread over a real HostPageIO, against the fake store's faults and read leases."""

from __future__ import annotations

from kvtier.fsm import CacheCore
from kvtier.fsm.l3 import L3Options, L3Tier, StoreCommand, StoreOp
from kvtier.testing.base import kit_layout
from kvtier.testing.l3_store import FakeStore, HostBytes, run_command, sync_driver


def _setup() -> tuple[CacheCore, HostBytes, FakeStore, list[str], dict[str, int]]:
    core = CacheCore(kit_layout(), 4, 8, policy="write_through")
    host = HostBytes(core, {})
    store = FakeStore()
    keys = L3Tier(core, L3Options(model="kit")).keys_for(("a", "b", "c"))
    ppu = {g.name: core.layout.pages_per_unit(g) for g in core.layout.history_groups}
    for j, k in enumerate(keys):
        store.objects[k] = host.blob(k, {g: [("unit", j, g, i) for i in range(n)] for g, n in ppu.items()})
    return core, host, store, keys, ppu


def _get(op: int, keys: list[str], ppu: dict[str, int]) -> StoreCommand:
    pages = tuple({g: [u * n + i for i in range(n)] for g, n in ppu.items()} for u in range(len(keys)))
    return StoreCommand(op, StoreOp.GET, tuple(keys), pages, 10.0)


def test_a_get_with_a_gap_delivers_only_the_prefix_before_it_into_its_own_pages() -> None:
    _, host, store, keys, ppu = _setup()
    cmd = _get(1, keys, ppu)
    for pm in cmd.pages:
        for g, ps in pm.items():
            for p in ps:
                host[(g, p)] = ("reserved", 1)
    store.fault = "gap"
    res = run_command(sync_driver(store, host.io), cmd)
    assert res.error is None and res.ok == (True, False, False)
    host.read_back(cmd.pages)
    for u, pm in enumerate(cmd.pages):
        for g, ps in pm.items():
            want = [("unit", 0, g, i) for i in range(ppu[g])] if u == 0 else [("reserved", 1)] * ppu[g]
            assert [host[(g, p)] for p in ps] == want


def test_a_torn_object_is_reported_corrupt_and_nothing_is_written() -> None:
    _, host, store, keys, ppu = _setup()
    cmd = _get(2, keys[:2], ppu)
    store.fault = "torn"
    res = run_command(sync_driver(store, host.io), cmd)
    assert res.ok == (False, False) and res.corrupt == (keys[0],)
    host.read_back(cmd.pages)
    assert all(v[0] == "garbage" for v in host.values())  # never written: the zeroed regions decode as garbage


def test_the_store_refuses_a_remove_while_a_get_s_read_lease_holds() -> None:
    _, host, store, keys, ppu = _setup()
    drv = sync_driver(store, host.io)
    store.lease_s, store.now = 2.0, 0.0
    assert run_command(drv, _get(3, keys[:1], ppu)).ok == (True,)
    store.now = 1.0
    assert run_command(drv, StoreCommand(4, StoreOp.REMOVE, (keys[0],), (), 10.0)).ok == (False,)
    store.now = 2.5
    assert run_command(drv, StoreCommand(5, StoreOp.REMOVE, (keys[0],), (), 10.0)).ok == (True,)
    assert keys[0] not in store.objects


def test_a_get_cancelled_before_it_runs_writes_no_page() -> None:
    _, host, store, keys, ppu = _setup()
    drv = sync_driver(store, host.io)
    cmd = _get(6, keys, ppu)
    drv.cancel(6)
    res = run_command(drv, cmd)
    assert res.error == "cancelled"
    assert not any(r.any() for r in host.regions.values())
