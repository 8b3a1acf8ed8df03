"""Lifecycle names and state sets built from the spec (kvtier.fsm.lifecycle.names, issue 11 "Meaning
from the spec"): a misspelt name fails where it is used with its own error, never as an
IllegalTransition; the state sets are exactly the states whose declared ``resources``
hold each resource; the spec's resource vocabulary is enforced when it is parsed; the
request and L3 name tables name themselves in their errors."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from core_helpers import h1, put, snapshot

from kvtier.fsm import CacheCore, ConfigError, IllegalTransition, KvtierError, SpecNameError, names
from kvtier.fsm.lifecycle.names import (
    DEVICE_READABLE,
    DEVICE_RESIDENT,
    HOST_PENDING,
    HOST_VISIBLE,
    L3_EVENT,
    L3_STATE,
    NODE_EVENT,
    NODE_STATE,
    REQUEST_EVENT,
    REQUEST_STATE,
    TERMINAL,
    Names,
)
from kvtier.fsm.lifecycle.spec import load_spec, parse_spec, spec_text

NODE = load_spec().node
REQUEST = load_spec().request


def test_every_declared_name_is_its_own_string() -> None:
    for table, declared in [(NODE_STATE, NODE.state_names), (NODE_EVENT, NODE.events),
                            (REQUEST_STATE, REQUEST.state_names), (REQUEST_EVENT, REQUEST.events)]:
        assert list(table) == sorted(declared)
        for name in declared:
            assert getattr(table, name) == name and name in table
    assert NODE_EVENT.demote == "demote" and NODE_STATE.root == "root"
    assert "demot" not in NODE_EVENT and 7 not in NODE_EVENT


def test_a_misspelt_name_raises_spec_name_error_naming_it() -> None:
    with pytest.raises(SpecNameError) as exc:
        NODE_EVENT.demot  # noqa: B018
    assert str(exc.value) == ("the spec declares no node event 'demot'; declared: " + str(sorted(NODE.events)))
    assert isinstance(exc.value, KvtierError) and isinstance(exc.value, AttributeError)
    assert not isinstance(exc.value, IllegalTransition)
    with pytest.raises(SpecNameError, match="^the spec declares no request state 'runing'; declared: "):
        REQUEST_STATE.runing  # noqa: B018
    assert not hasattr(NODE_STATE, "devise") and getattr(NODE_STATE, "devise", None) is None


def test_names_are_read_only_and_dunders_stay_plain_attribute_errors() -> None:
    with pytest.raises(AttributeError, match="^node state names are read-only$"):
        NODE_STATE.device = "host"  # type: ignore[misc]
    with pytest.raises(AttributeError, match="^node event names are read-only$"):
        NODE_EVENT.brand_new = "x"  # type: ignore[attr-defined]
    assert NODE_STATE.device == "device"
    with pytest.raises(AttributeError) as exc:
        NODE_STATE.__wrapped__  # noqa: B018  (protocol probes are not spec names)
    assert type(exc.value) is AttributeError
    assert copy.copy(NODE_STATE).device == "device"


def test_a_names_table_of_its_own() -> None:
    t = Names("colour", ["red", "blue"])
    assert (t.red, t.blue, list(t), "red" in t) == ("red", "blue", ["blue", "red"], True)
    with pytest.raises(SpecNameError) as exc:
        t.green  # noqa: B018
    assert str(exc.value) == "the spec declares no colour 'green'; declared: ['blue', 'red']"


def test_state_sets_are_the_states_declaring_each_resource() -> None:
    def holding(resource: str) -> frozenset[str]:
        return frozenset(st.name for st in NODE.states if resource in st.resources)

    assert DEVICE_RESIDENT == holding("device_pages") == {"device", "writing", "backed", "loading"}
    assert DEVICE_READABLE == holding("shared_read") == {"device", "writing", "backed"}
    assert HOST_VISIBLE == holding("host_pages") == {"backed", "host", "loading"}
    assert HOST_PENDING == holding("pending_host") == {"writing", "fetching"}
    assert TERMINAL == REQUEST.terminal_states == {"finished", "aborted"}
    assert set(names.__all__) >= {"DEVICE_RESIDENT", "DEVICE_READABLE", "HOST_VISIBLE", "HOST_PENDING", "TERMINAL"}


def test_state_sets_follow_the_spec_not_the_code() -> None:
    """Change a state's declared resources and the derived set changes with it."""
    text = spec_text("lifecycle.toml")
    loading = 'resources = ["device_pages", "host_pages", "host_pin", "loadback_op"]'
    assert text.count(loading) == 1
    spec = parse_spec(text.replace(loading, loading.replace('"device_pages"', '"device_pages", "shared_read"')))
    assert spec.node.states_holding("shared_read") == DEVICE_READABLE | {"loading"}
    assert spec.node.states_holding("device_pages") == DEVICE_RESIDENT


def test_resource_vocabulary() -> None:
    assert set(NODE.resources) == {"device_pages", "shared_read", "host_pages", "pending_host", "host_pin",
                                   "writeback_op", "loadback_op", "fetch_op"}
    assert all(doc.strip() for doc in NODE.resources.values())
    for st in NODE.states:
        assert set(st.resources) <= set(NODE.resources), st.name
    with pytest.raises(SpecNameError) as exc:
        NODE.states_holding("device_page")
    assert str(exc.value) == "the node lifecycle declares no resource 'device_page'"
    assert REQUEST.resources == {}  # no vocabulary declared: free-form resource prose, no derived sets
    with pytest.raises(SpecNameError, match="^the request lifecycle declares no resource 'device locks'$"):
        REQUEST.states_holding("device locks")
    assert NODE.state("loading").resources == ("device_pages", "host_pages", "host_pin", "loadback_op")
    with pytest.raises(SpecNameError) as exc:
        NODE.state("lodaing")
    assert str(exc.value) == "the node lifecycle declares no state 'lodaing'"


def test_a_state_listing_an_undeclared_resource_is_refused() -> None:
    text = spec_text("lifecycle.toml")
    device = 'resources = ["device_pages", "shared_read"]'
    assert text.count(device) == 1
    with pytest.raises(ConfigError) as exc:
        parse_spec(text.replace(device, 'resources = ["device_page", "shared_read"]'))
    assert str(exc.value) == "spec [node]: state 'device' lists undeclared resources ['device_page']"
    # declaring the name in the vocabulary makes it legal
    fixed = text.replace(device, 'resources = ["device_page", "shared_read"]').replace(
        "[node.resources]\n", '[node.resources]\ndevice_page = "a typo, declared"\n', 1)
    assert parse_spec(fixed).node.states_holding("device_page") == {"device"}


def test_the_root_state_is_declared_and_never_entered_or_left() -> None:
    root = NODE.state("root")
    assert root.resources == ()
    assert all(t.source != "root" and t.target != "root" for t in NODE.transitions)
    c = CacheCore(h1(), 4, 4)
    assert c.root.state == NODE_STATE.root
    put(c, "ab")
    assert c.root.state == "root" and all(n.state != "root" for n in c.nodes())


def test_a_misspelt_event_in_core_code_fails_at_first_use_and_changes_nothing() -> None:
    c = CacheCore(h1(), 4, 4)
    a = put(c, "ab").node
    before = snapshot(c)
    with pytest.raises(SpecNameError):
        c.trigger(a, NODE_EVENT.demot)  # the name fails before any event fires
    assert snapshot(c) == before and c.stats.triggers == 1
    with pytest.raises(IllegalTransition):  # a declared event in the wrong state is the machine's refusal
        c.trigger(a, NODE_EVENT.demote)
    assert snapshot(c) == before and a.state == "device"
    c.check_invariants()


SPEC = load_spec()


# ---------------------------------------------------------------------------- names
@pytest.mark.parametrize("table, what, declared", [
    (REQUEST_EVENT, "request event", SPEC.request.events),
    (L3_STATE, "l3 state", SPEC.l3.state_names if SPEC.l3 else ()),
    (L3_EVENT, "l3 event", SPEC.l3.events if SPEC.l3 else ()),
])
def test_request_and_l3_name_tables_name_themselves_in_errors(table: Any, what: str, declared: Any) -> None:
    assert declared and list(table) == sorted(declared)
    with pytest.raises(SpecNameError) as exc:
        table.no_such_name  # noqa: B018
    assert str(exc.value) == f"the spec declares no {what} 'no_such_name'; declared: {sorted(declared)}"
    with pytest.raises(AttributeError) as ro:
        table.no_such_name = "x"
    assert str(ro.value) == f"{what} names are read-only"
