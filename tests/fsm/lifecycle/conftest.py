"""Fixtures of the lifecycle tests: plain subjects for driving the raw lifecycle machines.

Each guard of the spec maps to the attribute that decides it and the values that make it
true or false (``guard_attrs``); a test fails if the spec gains a guard missing here.
``make_subject(lifecycle, state, values)`` builds a subject with a ``state`` and every
guard attribute of one lifecycle.
"""

from __future__ import annotations

from typing import Any

import pytest

# guard name -> (attribute, value making the guard true, value making it false)
GUARD_ATTRS: dict[str, dict[str, tuple[str, Any, Any]]] = {
    "node": {
        "parent_on_host": ("parent_on_host", True, False),
        "parent_on_device": ("parent_on_device", True, False),
        "parent_readable": ("parent_readable", True, False),
        "unlocked": ("lock_ref", 0, 1),
        "unborrowed": ("borrow_ref", 0, 2),
        "unpinned": ("host_pin", 0, 1),
        "has_device_child": ("has_device_child", True, False),
        "has_host_child": ("has_host_child", True, False),
    },
    "request": {
        "has_loadback": ("has_loadback", True, False),
        "has_own_writeback": ("has_own_writeback", True, False),
        "settled": ("settled", True, False),
    },
    "l3": {
        "host_visible": ("host_visible", True, False),
        "store_answered": ("store_answered", True, False),
        "lease_holds": ("lease_holds", True, False),
    },
    "transfer": {
        "handed_out": ("handed_out", True, False),
    },
}


class Subject:
    """A subject with a ``state`` and every guard attribute of one lifecycle."""

    __slots__ = ("state", "label", "__dict__")

    def __init__(self, lifecycle: str, state: str, values: dict[str, bool] | None = None) -> None:
        self.state = state
        self.label = "s1"
        for guard, (attr, true_value, false_value) in GUARD_ATTRS[lifecycle].items():
            want = (values or {}).get(guard, False)
            setattr(self, attr, true_value if want else false_value)

    def snapshot(self) -> dict[str, Any]:
        return {"state": self.state, **vars(self)}


@pytest.fixture
def guard_attrs() -> dict[str, dict[str, tuple[str, Any, Any]]]:
    """Guard name -> (attribute, value making it true, value making it false), per lifecycle."""
    return GUARD_ATTRS


@pytest.fixture
def make_subject() -> type[Subject]:
    """The subject class: ``make_subject(lifecycle, state, {guard: value})``."""
    return Subject
