"""Lifecycle (kvtier.fsm.lifecycle.machines) queries and construction details, and the public
``Observer`` alias an engine annotates its event-log callback with."""

from __future__ import annotations

import logging
import typing
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.fsm.lifecycle import machines
from kvtier.fsm.errors import GuardRejected, IllegalTransition
from kvtier.fsm.lifecycle.guards import GUARDS
from kvtier.fsm.lifecycle.machines import Lifecycle, node_lifecycle, request_lifecycle
from kvtier.fsm.lifecycle.spec import INTERNAL, TransitionSpec, load_spec


def _node(state: str, **kw: object) -> SimpleNamespace:
    base: dict[str, object] = dict(state=state, label=None, lock_ref=0, borrow_ref=0, host_pin=0, parent_on_host=True,
                parent_on_device=True, parent_readable=True, has_device_child=False,
                has_host_child=False)
    base.update(kw)
    return SimpleNamespace(**base)


def test_transitions_logger_is_quieted_on_import() -> None:
    # transitions logs INFO lines per trigger; the module lowers its logger to WARNING
    # unless the application configured it (ecosystem.md 1.2)
    assert logging.getLogger("transitions").level == logging.WARNING


def test_name_is_the_lifecycle_name() -> None:
    assert node_lifecycle().name == "node"
    assert request_lifecycle().name == "request"


@pytest.mark.parametrize("which", ["node", "request"])
def test_allowed_and_noop_match_the_spec(which: str) -> None:
    spec = getattr(load_spec(), which)
    lc = Lifecycle(spec, GUARDS[which])
    rows: dict[tuple[str, str], list[TransitionSpec]] = {}
    for t in spec.transitions:
        rows.setdefault((t.source, t.event), []).append(t)
    events = {t.event for t in spec.transitions}
    for state in spec.state_names:
        for event in events:
            key = (state, event)
            assert lc.allowed(state, event) == (key in rows)
            noop = key in rows and len(rows[key]) == 1 and rows[key][0].dest == INTERNAL \
                and not rows[key][0].guards
            assert lc.is_noop(state, event) == noop, key
    # no auto transitions (to_<state>) on the underlying machine: only the spec's events
    assert set(lc.machine.events) == events


def test_noop_examples() -> None:
    node, req = node_lifecycle(), request_lifecycle()
    assert node.is_noop("loading", "loadback_layer_done")
    assert node.is_noop("device", "split")
    assert not node.is_noop("device", "writeback_submit")  # moves, guarded
    assert not node.is_noop("writing", "writeback_ack")  # moves, unguarded
    assert req.is_noop("running", "forward_result")
    # internal but guarded, and one of two rows: not a no-op
    assert not req.is_noop("aborting", "forward_result")
    assert not req.is_noop("aborting", "writeback_ack")


def test_custom_describe_names_the_subject_in_errors() -> None:
    lc = Lifecycle(load_spec().node, GUARDS["node"], describe=lambda s: f"my-node<{s.state}>")
    n = _node("new")
    with pytest.raises(IllegalTransition) as exc:
        lc.check(n, "demote")
    assert exc.value.subject == "my-node<new>"
    with pytest.raises(IllegalTransition) as exc:
        lc.fire(n, "demote")
    assert str(exc.value).startswith("my-node<new>: event 'demote' refused in state 'new'")
    assert lc.describe(n) == "my-node<new>"


def test_default_describe_uses_label_else_repr() -> None:
    lc = node_lifecycle()
    assert lc.describe(_node("new", label=7)) == "node 7"
    n = _node("new")
    assert lc.describe(n) == repr(n)


def test_guard_rejection_names_the_guards_and_changes_nothing() -> None:
    lc = node_lifecycle()
    n = _node("backed", lock_ref=1, has_device_child=True)
    with pytest.raises(GuardRejected) as exc:
        lc.fire(n, "demote")
    assert exc.value.guards == ("unlocked", "!has_device_child")
    assert n.state == "backed"
    n.lock_ref, n.has_device_child = 0, False
    assert lc.fire(n, "demote") == "host" and n.state == "host"


def test_noop_fire_keeps_the_state() -> None:
    lc = node_lifecycle()
    n = _node("loading")
    assert lc.fire(n, "loadback_layer_done") == "loading"
    assert lc.fire(n, "loadback_ack") == "backed"


def test_shared_lifecycles_are_built_once() -> None:
    assert node_lifecycle() is node_lifecycle()
    assert request_lifecycle() is request_lifecycle()


def test_guard_type_alias_is_public_and_callable_typed() -> None:
    from collections.abc import Callable
    from typing import Any

    from kvtier.fsm.lifecycle import guards

    assert "Guard" in guards.__all__
    assert guards.Guard == Callable[[Any], bool]


# ---------------------------------------------------------------------------- Observer
def test_the_observer_alias_names_the_lifecycle_class() -> None:
    """``Observer`` is a public alias an engine annotates its event-log callback with: it
    resolves (in kvtier.fsm.lifecycle.machines) to a callable of (Lifecycle, subject, event, source,
    dest) returning None."""
    def hook(callback: machines.Observer) -> None: ...

    hints = typing.get_type_hints(hook, globalns=vars(machines), localns={"machines": machines})
    assert hints["callback"] == Callable[[machines.Lifecycle, Any, str, str, str], None]
    params, ret = typing.get_args(machines.Observer)
    assert params == ["Lifecycle", Any, str, str, str] and ret is None
    assert typing.get_origin(machines.Observer) is Callable
