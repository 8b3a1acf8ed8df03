"""The batched step's records (fsm/batch.py): defaults, immutability, no per-instance dict.

A step of a large batch builds these per item, so they are frozen, slotted dataclasses and
named tuples with documented defaults; these tests pin that contract."""

from __future__ import annotations

import dataclasses

import pytest

from kvtier.fsm.batch import OK, REFUSED, ForwardResult, ItemOutcome, Reservation, StepOutcome


def test_forward_result_defaults_ask_for_no_units_and_no_checkpoint() -> None:
    f = ForwardResult("a", 7)
    assert f == ("a", 7, (), False)
    assert f.new_units == () and f.checkpoint is False
    assert Reservation("a", 1) == ("a", 1)


def test_item_outcome_defaults_to_no_pages_and_no_error() -> None:
    item = ItemOutcome("a", OK)
    assert item.pages == {} and item.error is None
    assert item.ok is True
    assert ItemOutcome("a", REFUSED).ok is False
    assert ItemOutcome("b", OK).pages is not item.pages  # a fresh dict per record


@pytest.mark.parametrize(("record", "field"), [
    (ItemOutcome("a", OK), "status"),
    (StepOutcome(("a",), (OK,), (), (), {}, {}, {}), "errors"),
])
def test_outcomes_are_frozen_and_slotted(record: object, field: str) -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(record, field, None)
    assert not hasattr(record, "__dict__")
    assert type(record).__slots__
