"""The drain every example of the kit's machines ends with (kvtier.testing.drain): a clean run
drains, and one planted leak on any tier (a lock, pin or borrow receipt, a device page held
outside the tree, reserved host pages, a put pin, a read lease, an L3 operation that never
ends) fails the example as ``model_drain``, naming what was left; a replayed sequence runs
the same drain."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvtier.fsm.l3 import StoreOp
from kvtier.testing import _views as views
from kvtier.testing.core_machine import CoreMachine
from kvtier.testing.facade_machine import FacadeMachine
from kvtier.testing.l3_machine import L3TierMachine
from kvtier.testing.misuse_machine import MisuseMachine
from kvtier.testing.models import ModelViolation
from kvtier.testing.sequence import replay


def _core() -> CoreMachine:
    m = CoreMachine()
    m.setup(with_state=False, world=1, policy="write_through", dev_units=6, host_units=6, deadline=None,
            seed_keys=[["a", "b"]], layout="kit", faults=0)
    m.insert_and_write_through(key=["a", "b", "c"])
    m.drain()
    return m


def _facade() -> FacadeMachine:
    m = FacadeMachine()
    m.setup(**FacadeMachine.verify_setup(dev_units=6, host_units=6).args)
    m.admit(req=0, key=["a", "b"], chunk=8, tail=True)
    m.step_done(req=0, checkpoint=False, discard=False)
    m.drain(go=0)  # its writeback through to the host completes
    return m


def _l3() -> L3TierMachine:
    m = L3TierMachine()
    m.setup(layout="kit", dev_units=6, host_units=8, lease=5.0, deadline=3.0, prefetch_units=4,
            write_policy="host_write", hint=16, faults=0)
    m.fetch_pending(i=0, pick=2, evict=True, again=False)  # a get in flight, reserved host pages
    return m


def _misuse() -> MisuseMachine:
    m = MisuseMachine()
    m.setup(state=False, world=1, dev_units=4, host_units=4)
    m.admit(req=0, key=["a"])
    return m


@pytest.mark.parametrize("make", [_core, _facade, _l3, _misuse])
def test_a_clean_example_drains_to_full_pools(make: Callable[[], Any]) -> None:
    m = make()
    m.kit_end()
    assert m.kit_drained and m.kit_ok
    cores = m.cores if isinstance(m, L3TierMachine) else [m.cache if isinstance(m, CoreMachine) else m.cache.core]
    for core in cores:
        assert not views.nodes(core)
        assert all(a.free == a.capacity for a in core.device.values())
        assert all(a.free == a.capacity for a in (core.host or {}).values())
    if isinstance(m, L3TierMachine):
        assert all(t.outstanding().quiescent and not t.objects for t in m.tiers)


def _leak_lock(core: Any) -> None:
    core.lock(next(n for n in core.tree if n.state in ("device", "backed")), "leak")


def _leak_pin(core: Any) -> None:
    core.pin([next(n for n in core.tree if n.state in ("backed", "host"))], "leak")


def _leak_borrow(core: Any) -> None:
    core.borrow([next(n for n in core.tree if n.state in ("device", "backed"))], "leak")


def _leak_page(core: Any) -> None:
    core.alloc_device({views.history_groups(core)[0]: 1}, evict=False)


_RECEIPTS = "pins and borrows|node receipts"  # the core's drain / the facade's shutdown model


@pytest.mark.parametrize("leak, left", [(_leak_lock, "locks"), (_leak_pin, _RECEIPTS), (_leak_borrow, _RECEIPTS),
                                        (_leak_page, "pages outside the tree")])
@pytest.mark.parametrize("make", [_core, _facade])
def test_one_leaked_receipt_or_page_fails_the_drain(make: Callable[[], Any], leak: Callable[[Any], None],
                                                    left: str) -> None:
    m = make()
    core = m.cache if isinstance(m, CoreMachine) else m.cache.core
    leak(core)
    with pytest.raises(ModelViolation, match=left) as exc:
        m.kit_end()
    assert exc.value.invariant == "model_drain"


def test_a_leaked_receipt_on_the_misuse_machines_cache_fails_the_drain() -> None:
    m = _misuse()
    m.pump(ok=True)
    m.forward(req=0, finish=True)
    m.pump(ok=True)
    _leak_page(m.cache.core)
    with pytest.raises(ModelViolation, match="caller_pages=1"):
        m.kit_end()


def test_reserved_host_pages_no_get_owns_fail_the_l3_drain() -> None:
    m = _l3()
    core = m.cores[1]
    core.fetches.reserve(core.root, ("z",), 10_000)  # reserved pages no store operation will settle
    with pytest.raises(ModelViolation, match=r"instance 1's L3 tier.*reserved_pages=[1-9]"):
        m.kit_end()


def test_a_put_pin_that_is_never_released_fails_the_l3_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _l3()
    tier = m.tiers[0]
    monkeypatch.setattr(tier.core, "release", lambda receipt: None)  # a put's answer keeps its pin
    m.publish(i=0, key=["b", "b"])
    m.offer(i=0, key=["b", "b"])
    assert any(op.kind is StoreOp.PUT for op in tier.operations.values())
    with pytest.raises(ModelViolation, match="pins and borrows") as exc:
        m.kit_end()
    assert exc.value.invariant == "model_drain"


def test_a_lease_that_never_ends_fails_the_l3_drain() -> None:
    m = _l3()
    m.drain(roll=999)
    tier = m.tiers[0]
    leased = [o for o in tier.objects.values() if o.state == "leased"]
    assert leased
    leased[0].lease_until = float("inf")
    with pytest.raises(ModelViolation, match="leases=1"):
        m.kit_end()


def test_an_operation_the_tier_never_ends_fails_the_l3_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _l3()
    tier = m.tiers[0]
    monkeypatch.setattr(tier, "_complete", lambda result, now: None)  # answers are lost
    monkeypatch.setattr(tier, "expire", lambda now, cancel=None: [])
    with pytest.raises(ModelViolation, match="operations=") as exc:
        m.kit_end()
    assert exc.value.invariant == "model_drain"


def test_a_replayed_sequence_fails_where_the_drain_finds_a_leak(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _core()
    seq = m.kit_sequence()
    assert replay(seq).outcome == "pass"
    monkeypatch.setattr(CoreMachine, "drain", lambda self: _leak_lock(self.cache))
    res = replay(seq)
    assert (res.outcome, res.invariant, res.failed_step) == ("violation", "model_drain", len(seq.steps))


def test_a_failed_example_is_not_drained_again() -> None:
    m = _core()
    m.kit_ok = False  # a step raised: its failure is the one reported
    _leak_pin(m.cache)
    m.kit_end()
    assert not m.kit_drained


def test_the_reference_machine_fails_on_the_first_difference_with_the_model(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from kvtier.testing import reference
    from kvtier.testing.fuzz import campaign

    clean = campaign(steps=300, seed_value=1, mix={"reference": 1.0}, progress=False)
    assert clean.ok and clean.product_sources == {"reference"}
    admit = reference.ReferenceCache.admit

    def off_by_one(self: Any, *args: Any) -> Any:  # a model that counts one device token more
        hit = admit(self, *args)
        return hit if hit is None or not hit.hit_tokens else reference.Hit(hit.device_tokens + 1, hit.host_tokens)

    monkeypatch.setattr(reference.ReferenceCache, "admit", off_by_one)
    # unshrunk (a CI gate wants the verdict): the failing example itself is saved and replays
    res = campaign(steps=3000, seed_value=1, mix={"reference": 1.0}, progress=False, save=tmp_path / "f.json",
                   shrink=False)
    assert res.failure_result is not None and res.failure_result.invariant == "model_reference"
    assert "differs in admit" in res.failure_result.message + (res.failure_result.detail or "")
    assert res.first_failure_step is not None and res.first_failure_step <= res.steps
    assert res.failure is not None and "not shrunk" in res.failure.description
    again = replay(res.failure)
    assert (again.outcome, again.invariant) == ("violation", "model_reference")
