"""The fuzz drives the L3 tier as a product (kvtier.testing.l3_machine): every [l3]
transition and every node fetch transition but the unreachable split is driven by the
product machine, and a core that shows a failed get's pages is caught by the content check."""

from __future__ import annotations

import io

import pytest

from kvtier.fsm.fetch import FetchTable
from kvtier.testing.coverage import UNREACHABLE_BY_PRODUCT
from kvtier.testing.fuzz import DEFAULT_MIX, campaign


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
        return orig(self, op_id, len(self.nodes(op_id)))  # the bug: every reserved node acked

    monkeypatch.setattr(FetchTable, "settle", settle_all)
    res = campaign(steps=3000, seed_value=1, mix={"l3tier": 1.0}, progress=False, stream=io.StringIO(),
                   save=f"{tmp_path}/failure.json")
    assert not res.ok and res.failure_result is not None
    assert res.failure_result.invariant == "loaded_equals_written"
