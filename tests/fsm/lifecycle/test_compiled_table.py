"""The compiled transition table the hot path fires through, and the checked mode that
holds it to the ``transitions`` machine it was derived from (``kvtier.fsm.lifecycle.machines``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transitions import Machine

from kvtier.fsm import GuardRejected, IllegalTransition, InvariantViolation
from kvtier.fsm.lifecycle.guards import GUARDS
from kvtier.fsm.lifecycle.machines import (Lifecycle, compile_machine, l3_lifecycle, node_lifecycle, request_lifecycle,
                                           set_checked, transfer_lifecycle)
from kvtier.fsm.lifecycle.spec import INTERNAL, load_spec

LIFECYCLES = {"node": node_lifecycle, "request": request_lifecycle, "l3": l3_lifecycle,
              "transfer": transfer_lifecycle}


@pytest.fixture
def checked():
    before = set_checked(True)
    yield
    set_checked(before)


@pytest.fixture
def unchecked():
    before = set_checked(False)
    yield
    set_checked(before)


def _node(state: str = "device", **kw: object) -> SimpleNamespace:
    fields = dict(state=state, lock_ref=0, borrow_ref=0, host_pin=0, parent_on_host=True, parent_on_device=True,
                  parent_readable=True, has_device_child=False, has_host_child=False, label=1)
    fields.update(kw)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("name", sorted(LIFECYCLES))
def test_the_table_has_every_transition_of_the_spec_in_order(name: str) -> None:
    lc = LIFECYCLES[name]()
    spec = lc.spec
    expected: dict[tuple[str, str], list[tuple[tuple[tuple[str, bool], ...], str | None]]] = {}
    for t in spec.transitions:
        guards = tuple((g.name, not g.negated) for g in t.guards)
        # transitions lists a transition's conditions before its unless entries
        guards = tuple(g for g in guards if g[1]) + tuple(g for g in guards if not g[1])
        expected.setdefault((t.source, t.event), []).append((guards, None if t.dest == INTERNAL else t.dest))
    by_function = {id(fn): g for g, fn in lc.guards.items()}
    got = {key: [(tuple((by_function[id(fn)], v) for fn, v in guards), dest) for guards, dest in rows]
           for key, rows in lc.compiled.items()}
    assert got == expected
    assert len(got) == len(lc._table) > (2 if name == "transfer" else 5)


def test_fire_moves_rejects_and_refuses_as_before(unchecked: None) -> None:
    lc = node_lifecycle()
    node = _node("device")
    assert lc.fire(node, "writeback_submit") == "writing" and node.state == "writing"
    locked = _node("backed", lock_ref=1)
    with pytest.raises(GuardRejected, match="unlocked") as err:
        lc.fire(locked, "demote")
    assert locked.state == "backed" and "unlocked" in err.value.guards
    with pytest.raises(IllegalTransition):
        lc.fire(_node("new"), "demote")


def test_an_internal_transition_keeps_the_state_and_is_observed(unchecked: None) -> None:
    lc = node_lifecycle()
    seen: list[tuple[str, str, str]] = []
    lc.observer = lambda _lc, _s, event, src, dest: seen.append((event, src, dest))
    try:
        internal = next(k for k, rows in lc.compiled.items() if rows[0][1] is None and not rows[0][0])
        node = _node(internal[0])
        assert lc.fire(node, internal[1]) == internal[0] == node.state
    finally:
        lc.observer = None
    assert seen == [(internal[1], internal[0], internal[0])]


def _corrupt(lc: Lifecycle, key: tuple[str, str], dest: str) -> dict:
    saved = dict(lc.compiled)
    guards, _ = lc.compiled[key][0]
    lc.compiled[key] = ((guards, dest),) + lc.compiled[key][1:]
    return saved


def test_the_checked_mode_catches_a_table_that_disagrees(checked: None) -> None:
    lc = node_lifecycle()
    saved = _corrupt(lc, ("device", "writeback_submit"), "host")
    try:
        node = _node("device")
        with pytest.raises(InvariantViolation, match="compiled table gives 'host', transitions 'writing'") as err:
            lc.fire(node, "writeback_submit")
        assert err.value.invariant == "compiled_lifecycle" and node.state == "device"
        set_checked(False)
        assert lc.fire(node, "writeback_submit") == "host"  # unchecked: the table alone decides
    finally:
        lc.compiled.clear()
        lc.compiled.update(saved)


def test_the_checked_mode_catches_a_missing_and_an_extra_row(checked: None) -> None:
    lc = node_lifecycle()
    saved = dict(lc.compiled)
    try:
        del lc.compiled[("device", "writeback_submit")]
        with pytest.raises(InvariantViolation, match="gives '<illegal>', transitions 'writing'"):
            lc.fire(_node("device"), "writeback_submit")
        lc.compiled[("new", "demote")] = (((), "host"),)
        with pytest.raises(InvariantViolation, match="gives 'host', transitions '<illegal>'"):
            lc.fire(_node("new"), "demote")
        lc.compiled[("backed", "demote")] = (((), "host"),)  # guards dropped: transitions rejects
        with pytest.raises(InvariantViolation, match="gives 'host', transitions '<rejected>'"):
            lc.fire(_node("backed", lock_ref=1), "demote")
    finally:
        lc.compiled.clear()
        lc.compiled.update(saved)


def test_the_checked_mode_agrees_on_every_transition_of_every_lifecycle(checked: None) -> None:
    """Each (state, event) of the table fired on subjects whose guards take every value."""
    fired = 0
    for name, make in LIFECYCLES.items():
        lc = make()
        for (state, event) in lc.compiled:
            for value in (False, True):
                subject = SimpleNamespace(state=state, label="s", **{f: value for f in _guard_fields(name)})
                try:
                    lc.fire(subject, event)
                except GuardRejected:
                    assert subject.state == state
                fired += 1
    assert fired == 2 * sum(len(m().compiled) for m in LIFECYCLES.values())


def _guard_fields(name: str) -> tuple[str, ...]:
    return {"node": ("lock_ref", "borrow_ref", "host_pin", "parent_on_host", "parent_on_device", "parent_readable",
                     "has_device_child", "has_host_child"),
            "request": ("has_loadback", "has_own_writeback", "settled"),
            "l3": ("host_visible", "store_answered", "lease_holds"), "transfer": ("handed_out",)}[name]


def test_set_checked_reaches_every_built_lifecycle_and_returns_the_old_mode() -> None:
    before = set_checked(True)
    try:
        assert all(m().checked for m in LIFECYCLES.values())
        assert set_checked(False) is True
        assert not any(m().checked for m in LIFECYCLES.values())
        fresh = Lifecycle(load_spec().node, GUARDS["node"])
        assert fresh.checked is False
    finally:
        set_checked(before)


def test_compile_machine_refuses_a_condition_it_cannot_read_back() -> None:
    m = Machine(model=None, states=["a", "b"], initial="a", auto_transitions=False)
    m.add_transition("go", "a", "b", conditions=[lambda _e: True])
    with pytest.raises(ValueError, match="'a' --go--> has no guard to compile"):
        compile_machine(m)
