"""Pool sizing from a byte budget against its definition (kvtier.testing.budget_model): a
Hypothesis property over random page geometries, budgets and weights, and a split that
rounds a share up, or leaves a whole page of it unused, caught."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.transfer.pools as pools
from kvtier.fsm import CacheGroupSpec, ComponentSpec
from kvtier.testing.budget_model import check_budget_split, check_split_of_pool, group_page_bytes
from kvtier.testing.models import ModelViolation


@st.composite
def geometries(draw: Any) -> list[CacheGroupSpec]:
    out = []
    for g in range(draw(st.integers(1, 4))):
        layers = tuple(sorted(draw(st.sets(st.integers(0, 7), min_size=1, max_size=4))))
        comps = tuple(ComponentSpec(f"c{i}", draw(st.integers(1, 300))) for i in range(draw(st.integers(1, 3))))
        if draw(st.booleans()):
            out.append(CacheGroupSpec(f"g{g}", "history", draw(st.integers(1, 8)), 1, layers, comps))
        else:
            out.append(CacheGroupSpec(f"g{g}", "state", 2, 1, layers, comps, window=draw(st.integers(1, 8))))
    return out


@settings(max_examples=300, deadline=None)
@given(specs=geometries(), budget=st.integers(1, 1 << 22), weighted=st.booleans(), data=st.data())
def test_a_budget_is_split_into_the_whole_pages_each_share_holds(specs: list[CacheGroupSpec], budget: int,
                                                                  weighted: bool, data: Any) -> None:
    weights = ({s.name: data.draw(st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0, 7.25])) for s in specs}
               if weighted else None)
    if weights is not None and not any(weights.values()):
        weights[specs[0].name] = 1.0
    got = check_budget_split(specs, budget, weights)
    if got is not None:
        assert sum(got[s.name] * group_page_bytes(s) for s in specs) <= budget


@settings(max_examples=100, deadline=None)
@given(specs=geometries(), pages=st.integers(1, 64), slack=st.integers(0, 1 << 20))
def test_a_pool_s_own_size_as_a_budget_gives_its_pages_back(specs: list[CacheGroupSpec], pages: int,
                                                            slack: int) -> None:
    check_split_of_pool(specs, {s.name: pages + i for i, s in enumerate(specs)}, slack)


SPECS = [CacheGroupSpec("kv", "history", 4, 1, (0, 1, 2), (ComponentSpec("k", 48), ComponentSpec("ix", 37))),
         CacheGroupSpec("swa", "state", 2, 1, (1, 2), (ComponentSpec("s", 64),), window=4)]


def test_the_page_bytes_are_every_component_in_every_layer() -> None:
    assert [group_page_bytes(s) for s in SPECS] == [(48 + 37) * 3, 64 * 2] == [s.page_bytes for s in SPECS]
    assert check_budget_split(SPECS, 10_000) == {"kv": 5000 // 255, "swa": 5000 // 128}
    assert check_budget_split(SPECS, 300) is None  # kv's share of 150 bytes holds no page of 255


def _planted(rounding: Any) -> Any:
    real = pools.pages_for_budget

    def split(specs: Any, budget: int, weights: Any = None) -> dict[str, int]:
        got = real(specs, budget, weights)
        return {n: rounding(p) for n, p in got.items()}
    return split


@pytest.mark.parametrize("rounding, text", [(lambda p: p + 1, "take 10220 bytes"),
                                            (lambda p: max(1, p - 1), "holds")])
def test_a_split_off_by_one_page_is_caught(rounding: Any, text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pools, "pages_for_budget", _planted(rounding))
    with pytest.raises(ModelViolation, match=text) as e:
        check_budget_split(SPECS, 10_000)
    assert e.value.invariant == "model_budget"


def test_the_engine_machine_checks_its_host_pool_s_split(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.testing.base import kit_layout
    from kvtier.testing.engine_plug import EngineTransfer

    layout = kit_layout()
    pages = {g.name: 4 for g in layout.groups}
    EngineTransfer(1, layout, pages, pages)  # the correct split passes
    monkeypatch.setattr(pools, "pages_for_budget", _planted(lambda p: p + 1))
    with pytest.raises(ModelViolation, match="model_budget|over its share"):
        EngineTransfer(1, layout, pages, pages)
