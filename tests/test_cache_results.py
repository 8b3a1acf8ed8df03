"""The core's result records and enums (fsm/cache.py): frozen, slotted, defaults, wire
values and type hints (written to kill mutants that survived bench/mutation)."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from kvtier.fsm import cache
from kvtier.fsm.cache import InsertResult, LoadResult, MatchMode, MatchResult, WritePolicy


def _dummy(cls: type) -> object:
    return cls(**{f.name: None for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING})


@pytest.mark.parametrize("cls", [MatchResult, InsertResult, LoadResult])
def test_results_are_frozen_and_slotted(cls: type) -> None:
    r = _dummy(cls)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(r, dataclasses.fields(cls)[0].name, 1)
    assert not hasattr(r, "__dict__")
    assert "__slots__" in cls.__dict__


def test_insert_result_created_defaults_to_empty() -> None:
    r = InsertResult(node=None, published_units=0, pages={}, duplicates={}, kept={})  # type: ignore[arg-type]
    assert r.created == ()


def test_enum_wire_values() -> None:
    assert [p.value for p in WritePolicy] == ["write_through", "write_through_selective", "write_back"]
    assert WritePolicy("write_through_selective") is WritePolicy.WRITE_THROUGH_SELECTIVE
    assert [m.value for m in MatchMode] == ["prefix_reuse", "state_recovery"]


def test_page_map_alias_and_type_hints() -> None:
    assert cache.PageMap == dict[str, list[int]]
    hints = typing.get_type_hints(InsertResult)
    assert hints["pages"] == dict[str, list[int]]
    typing.get_type_hints(MatchResult)
    typing.get_type_hints(LoadResult)
