"""The fuzz drives the L3 tier as a product (kvtier.testing.l3_machine): every [l3]
transition and every node fetch transition but the unreachable split is driven by the
product machine, a core that shows a failed get's pages is caught by the content check, a
refused call that changes state and a blind l3 check are caught by the hostile calls and
the corruptions (kvtier.testing.l3_cases)."""

from __future__ import annotations

import io
import itertools
from collections.abc import Sequence

import pytest

from kvtier.fsm.l3 import checks as l3checks
from kvtier.fsm.errors import InvariantViolation
from kvtier.fsm.node.fetch import FetchTable
from kvtier.fsm.l3 import L3Tier
from kvtier.testing.coverage import UNREACHABLE_BY_PRODUCT
from kvtier.testing.fuzz import DEFAULT_MIX, campaign
from kvtier.testing.l3_cases import HOSTILE
from kvtier.testing.l3_machine import L3TierMachine


def test_product_machine_drives_every_l3_transition() -> None:
    res = campaign(steps=3000, seed_value=1, mix={"l3tier": 1.0}, progress=False, stream=io.StringIO())
    assert res.ok, res.report()
    assert "l3tier" in DEFAULT_MIX and res.product_sources == {"l3tier"}
    l3_items = [i for i in res.coverage.product_required() if i.label.startswith("l3:") or "fetch" in i.label]
    assert len(l3_items) == 13 + 3 + 4  # 13 [l3] transitions (a failed get leaves its object leased too), 3 node fetch ones, 4 accepting guard values
    missing = [i.label for i in res.coverage.product_missing({"l3tier"}) if i in l3_items]
    assert missing == []
    assert "node: fetching --split--> fetching" in UNREACHABLE_BY_PRODUCT


def test_a_failed_get_made_visible_is_caught(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    orig = FetchTable.settle

    def settle_all(self: FetchTable, op_id: int, acked: int) -> list[object]:
        n = len(self.nodes(op_id))
        valid = isinstance(acked, int) and not isinstance(acked, bool) and 0 <= acked <= n
        return orig(self, op_id, n if valid else acked)  # the bug: every reserved node acked

    monkeypatch.setattr(FetchTable, "settle", settle_all)
    res = campaign(steps=3000, seed_value=1, mix={"l3tier": 1.0}, progress=False, stream=io.StringIO(),
                   save=f"{tmp_path}/failure.json")
    assert not res.ok and res.failure_result is not None
    assert res.failure_result.invariant == "loaded_equals_written"


def _machine_with_a_get_in_flight() -> L3TierMachine:
    m = L3TierMachine()
    m.setup(layout="kit", dev_units=6, host_units=8, lease=5.0, deadline=3.0, prefetch_units=4,
            write_policy="host_write", hint=16, faults=0)
    m.fetch_pending(i=0, pick=2, evict=True, again=False)  # a third engine's prefix ("ab"), fetched
    assert len(m.cores[0].fetches) == 1 and m.tiers[0].objects
    return m


def test_the_machine_refuses_hostile_calls_and_sees_every_corruption() -> None:
    m = _machine_with_a_get_in_flight()
    m.fetch_pending(i=0, pick=2, evict=False, again=True, sweep=True)  # every case, a get in flight
    assert m.refused >= len(HOSTILE)
    m.check_cores()
    m.check_tiers()
    m.check_loaded_equals_written()


def test_a_refused_call_that_changes_state_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    orig = L3Tier.remove

    def remove_then_check(self: L3Tier, keys: Sequence[str], now: float) -> int:
        if not isinstance(keys, str) and isinstance(keys, Sequence):  # the bug: defers busy keys, then refuses
            orig(self, [k for k in itertools.takewhile(lambda k: isinstance(k, str), keys) if k in self.objects],
                 now)
        return orig(self, keys, now)

    monkeypatch.setattr(L3Tier, "remove", remove_then_check)
    m = _machine_with_a_get_in_flight()
    with pytest.raises(InvariantViolation, match="hostile L3 call 'remove arguments'.*changed an instance"):
        m.hostile(i=0, case=[name for name, _ in HOSTILE].index("remove arguments"), v=2)


def test_a_blind_l3_check_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(l3checks, "check_l3", lambda tier: None)
    m = _machine_with_a_get_in_flight()
    with pytest.raises(AssertionError, match="went unnoticed by the l3 checks"):
        m.corrupt(i=0, v=0)


def _count_ok_flags(self: L3Tier, op: object, res: object, now: float) -> None:
    """A tier that loads every object flagged ok, not the leading run (holes included)."""
    oks = list(res.ok) if res.error is None else []  # type: ignore[attr-defined]
    object.__setattr__(res, "ok", tuple(sorted(oks, reverse=True)))  # the ok flags moved to the front
    _ON_GET(self, op, res, now)


_ON_GET = L3Tier._on_get


@pytest.mark.parametrize("how", ["holes", "short"])
def test_a_get_answered_with_holes_loads_only_its_leading_run(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    m = L3TierMachine()
    m.setup(layout="kit", dev_units=6, host_units=8, lease=0.0, deadline=3.0, prefetch_units=4,
            write_policy="host_write", hint=16, faults=0)
    m.gappy_get(i=0, pick=3, how=how)  # a correct tier: leading run loaded, the rest released
    m.kit_check()
    assert m.tiers[0].outstanding().reserved_pages == 0 and m.tiers[0].stats.get_ok >= 1
    if how == "holes":
        monkeypatch.setattr(L3Tier, "_on_get", _count_ok_flags)
        with pytest.raises(Exception, match="model_l3_fetched|loaded_equals_written"):
            m.gappy_get(i=1, pick=3, how=how)
            m.kit_check()
