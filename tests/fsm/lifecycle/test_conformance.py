"""Conformance of the built machines to the spec, generated from spec/lifecycle.toml.

For every lifecycle, every (state, event) pair and every combination of the values of
the guards involved, the machine must do exactly what the spec says: move to the first
candidate transition whose guards hold, raise GuardRejected naming the false guards
when candidates exist but none holds, raise IllegalTransition when there is none, and
change nothing when it raises. Every transition and every guard (true and false) must
be exercised.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from transitions import MachineError

from kvtier.fsm import GuardRejected, IllegalTransition, KvtierError
from kvtier.fsm.lifecycle.machines import Lifecycle, l3_lifecycle, node_lifecycle, request_lifecycle
from kvtier.fsm.lifecycle.spec import load_spec

LIFECYCLES = {"node": node_lifecycle, "request": request_lifecycle, "l3": l3_lifecycle}


def test_stub_table_covers_every_spec_guard(guard_attrs: dict[str, dict[str, Any]]) -> None:
    spec = load_spec()
    for lc in spec.lifecycles:
        assert set(guard_attrs[lc.name]) == set(lc.guards), lc.name


@pytest.mark.parametrize("name", ["node", "request", "l3"])
def test_every_state_event_pair_and_guard_combination(name: str, make_subject: Callable[..., Any]) -> None:
    machine: Lifecycle = LIFECYCLES[name]()
    spec = machine.spec
    fired: set[tuple[str, str, str]] = set()
    guard_values: set[tuple[str, bool]] = set()
    for state in spec.state_names:
        for event in spec.events:
            rows = spec.candidates(state, event)
            involved = sorted({g.name for t in rows for g in t.guards})
            for combo in itertools.product([False, True], repeat=len(involved)):
                values = dict(zip(involved, combo))
                subject = make_subject(name, state, values)
                before = subject.snapshot()
                expected = next((t for t in rows
                                 if all(values[g.name] != g.negated for g in t.guards)), None)
                if expected is not None:
                    assert machine.check(subject, event) == expected.target
                    assert subject.snapshot() == before
                    assert machine.fire(subject, event) == expected.target
                    assert subject.state == expected.target
                    fired.add((expected.source, expected.event, expected.dest))
                    for g in expected.guards:
                        guard_values.add((g.name, values[g.name]))
                elif rows:
                    with pytest.raises(GuardRejected) as info:
                        machine.fire(subject, event)
                    false_labels = {g.label for t in rows for g in t.guards
                                    if values[g.name] == g.negated}
                    assert set(info.value.guards) == false_labels
                    assert info.value.state == state and info.value.event == event
                    assert subject.snapshot() == before
                    for label in false_labels:  # "!g" false means g was true
                        guard_values.add((label.lstrip("!"), label.startswith("!")))
                else:
                    with pytest.raises(IllegalTransition) as info2:
                        machine.fire(subject, event)
                    assert info2.value.state == state and info2.value.event == event
                    assert subject.snapshot() == before
    every = {(t.source, t.event, t.dest) for t in spec.transitions}
    assert fired == every, f"transitions never fired: {sorted(every - fired)}"
    every_guard = {(g, v) for g in spec.guards for v in (True, False)}
    assert every_guard <= guard_values, f"guard values never seen: {sorted(every_guard - guard_values)}"


def test_errors_name_subject_state_event_and_subclass_machine_error(make_subject: Callable[..., Any]) -> None:
    machine = node_lifecycle()
    subject = make_subject("node", "backed", {"unlocked": False, "unborrowed": True})
    with pytest.raises(GuardRejected) as info:
        machine.fire(subject, "demote")
    err = info.value
    assert isinstance(err, KvtierError) and isinstance(err, MachineError)
    assert err.guards == ("unlocked",)
    assert "node s1" in str(err) and "'demote'" in str(err) and "'backed'" in str(err)
    with pytest.raises(IllegalTransition, match=r"node s1: event 'create' refused in state 'backed'"):
        machine.fire(subject, "create")


def test_unknown_event_is_illegal_not_a_silent_false(make_subject: Callable[..., Any]) -> None:
    with pytest.raises(IllegalTransition):
        request_lifecycle().fire(make_subject("request", "running"), "teleport")


def test_one_shared_machine_registers_no_models(make_subject: Callable[..., Any]) -> None:
    machine = node_lifecycle()
    subjects = [make_subject("node", "new", {"parent_readable": True}) for _ in range(100)]
    for s in subjects:
        machine.fire(s, "create")
    assert all(s.state == "device" for s in subjects)
    assert machine.machine.models == []
    assert node_lifecycle() is machine
