"""The spec loader (kvtier.fsm.lifecycle.spec): bad specs are refused with a ConfigError naming the
problem; the shipped spec names the 15 reference invariants; its prose (spec/README.md)
names every state, event, guard and invariant of the TOML; the spec records' defaults (no
calls, no ``[l3]``) and the exact message for a call naming an undeclared state."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kvtier.fsm import ConfigError
from kvtier.fsm.lifecycle.spec import INTERNAL, GuardRef, LifecycleSpec, Specification, load_spec, parse_spec, spec_text

#: the reference list of lifecycle invariants the spec is built on (the project's background,
#: copied verbatim beside this file so that the check runs on every clone)
INVARIANTS_MD = Path(__file__).resolve().parent / "reference_invariants.md"

#: invariants.md number -> (its bold title, the spec's name for it)
REFERENCE_INVARIANTS = {
    1: ("Root-closed host set.", "root_closed_host"),
    2: ("Host copy means acknowledged host data.", "host_means_acked"),
    3: ("Writeback sources are immutable until the acknowledgement.", "writeback_source_immutable"),
    4: ("Loadback sources are pinned until the acknowledgement.", "loadback_source_pinned"),
    5: ("Locks and pins are counts with receipts.", "counts_with_receipts"),
    6: ("Splits preserve ownership.", "split_preserves_ownership"),
    7: ("Every started operation ends exactly once.", "operation_ends_once"),
    8: ("Abort and retract release exactly once, after fencing.", "release_once_after_fence"),
    9: ("Host eviction only from host leaves.", "host_evict_leaves"),
    10: ("Failure is never reported as success.", "failure_not_success"),
    11: ("Admission is atomic and live.", "atomic_admission"),
    12: ("Loaded data equals written data.", "loaded_equals_written"),
    13: ("Conservation.", "conservation"),
    14: ("Borrowed pages stay.", "borrowed_pages_stay"),
    15: ("Exact continuation state.", "exact_continuation_state"),
    16: ("Forward fence.", "forward_fence"),
}
#: invariants kvtier adds to the reference list.
EXTRA_INVARIANTS = {"state_matches_resources",
                    # the hot path's compiled transition table agrees with the transitions machine
                    "compiled_lifecycle",
                    # the L3 tier (spec [l3]); not in the reference list, which predates it
                    "l3_put_source_pinned", "l3_visible_by_answer", "l3_get_invisible", "l3_ends_by_deadline",
                    "l3_lease_blocks_remove",
                    # a transfer past its deadline keeps its pages until its copy ended (spec [transfer])
                    "copy_fence"}


def _lifecycle(name: str) -> str:
    return f'''
[{name}]
title = "T"
description = "D"
subject = "{name}"
initial = "a"

[{name}.states.a]
description = "A"

[{name}.states.b]
description = "B"
resources = ["pages"]

[[{name}.transitions]]
event = "go"
source = ["a"]
dest = "b"
guards = ["ok"]

[[{name}.transitions]]
event = "stay"
source = ["a", "b"]
dest = "="

[{name}.guards.ok]
doc = "G"
'''


MINIMAL = ("version = 1\n" + _lifecycle("node") + _lifecycle("request")
           + '\n[invariants.x]\nstatement = "S"\n')


def test_minimal_spec_parses() -> None:
    spec = parse_spec(MINIMAL)
    assert spec.version == 1 and spec.invariants == {"x": "S"}
    node = spec.node
    assert node.state_names == ("a", "b") and node.initial == "a"
    assert node.states[1].resources == ("pages",)
    assert node.events == ("go", "stay")
    assert [(t.event, t.source, t.dest, t.target) for t in node.transitions] == [
        ("go", "a", "b", "b"), ("stay", "a", INTERNAL, "a"), ("stay", "b", INTERNAL, "b")]
    assert node.transitions[0].guards[0].label == "ok"
    assert node.guards == {"ok": "G"}


def _node_only(old: str, new: str) -> str:
    """MINIMAL with the first occurrence (in [node]) of ``old`` replaced."""
    assert old in MINIMAL
    return MINIMAL.replace(old, new, 1)


DUPLICATE = ('[[node.transitions]]\nevent = "go"\nsource = ["a"]\ndest = "a"\nguards = ["ok"]\n'
             '\n[[node.transitions]]')


@pytest.mark.parametrize("text, message", [
    (_node_only('source = ["a"]', 'source = ["zz"]'), r"spec \[node\]: event 'go' has undeclared source 'zz'"),
    (_node_only('dest = "b"', 'dest = "zz"'), r"spec \[node\]: event 'go' has undeclared dest 'zz'"),
    (_node_only('guards = ["ok"]', 'guards = ["!nope"]'), r"spec \[node\]: event 'go' uses undeclared guard 'nope'"),
    (_node_only('initial = "a"', 'initial = "zz"'), r"spec \[node\]: initial state 'zz' is not declared"),
    (_node_only("[[node.transitions]]", DUPLICATE), r"spec \[node\]: duplicate transition 'go' from 'a' with guards \['ok'\]"),
    (_node_only("[node.guards.ok]", '[node.guards.spare]\ndoc = "unused"\n\n[node.guards.ok]'),
     r"spec \[node\]: guards declared but never used: \['spare'\]"),
    (_node_only('title = "T"\n', ""), r"spec \[node\]: malformed \(KeyError\('title'\)\)"),
    (_node_only('description = "A"\n', ""), r"spec \[node\]: malformed \(KeyError\('description'\)\)"),
    (MINIMAL.replace('[[request.transitions]]\nevent = "go"\nsource = ["a"]\ndest = "b"',
                     '[[request.transitions]]\nevent = "go"\nsource = ["q"]\ndest = "b"'),
     r"spec \[request\]: event 'go' has undeclared source 'q'"),
    (_node_only("[node.states.a]", '[node.resources]\nother = "O"\n\n[node.states.a]'),
     r"spec \[node\]: state 'b' lists undeclared resources \['pages'\]"),
    (MINIMAL + "[broken\n", r"spec: not valid TOML: .+"),
    (MINIMAL.replace("version = 1\n", ""), r"spec: malformed \(KeyError\('version'\)\)"),
    (MINIMAL.split("\n[request]")[0] + '\n[invariants.x]\nstatement = "S"\n',
     r"spec: malformed \(KeyError\('request'\)\)"),
    (MINIMAL.replace('statement = "S"', 'text = "S"'), r"spec: malformed \(KeyError\('statement'\)\)"),
])
def test_bad_specs_are_refused_naming_the_problem(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_spec(text)
    assert re.fullmatch(message, str(exc.value)), str(exc.value)


def test_resource_vocabulary_is_optional_and_parsed() -> None:
    assert parse_spec(MINIMAL).node.resources == {}  # none declared: resources stay free-form prose
    declared = parse_spec(_node_only("[node.states.a]", '[node.resources]\npages = "P"\n\n[node.states.a]'))
    assert declared.node.resources == {"pages": "P"} and declared.request.resources == {}
    assert declared.node.states_holding("pages") == {"b"}


def test_guard_refs_docs_and_records() -> None:
    assert GuardRef("ok").negated is False and GuardRef("ok").label == "ok"
    assert GuardRef("ok", True).label == "!ok"
    # guard names are any identifiers; only a leading "!" negates
    text = MINIMAL.replace('guards = ["ok"]', 'guards = ["!Xok"]', 1).replace("[node.guards.ok]", "[node.guards.Xok]", 1)
    go = parse_spec(text).node.transitions[0]
    assert go.guards == (GuardRef("Xok", True),)
    documented = MINIMAL.replace('dest = "b"\n', 'dest = "b"\ndoc = "moves on"\n', 1)
    assert [t.doc for t in parse_spec(documented).node.transitions] == ["moves on", "", ""]
    spec = parse_spec(MINIMAL)
    records = [spec, spec.node, spec.node.states[0], spec.node.transitions[0], spec.node.transitions[0].guards[0]]
    for record in records:
        assert not hasattr(record, "__dict__"), type(record).__name__  # slotted
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, "version" if record is spec else "name" if hasattr(record, "name") else "event", 2)


def test_shipped_spec_is_consistent() -> None:
    spec = load_spec()
    assert spec is load_spec()  # parsed once
    assert spec.version == 1
    assert spec.node.initial == "new" and spec.request.initial == "waiting"
    assert set(spec.node.state_names) >= {"device", "writing", "backed", "host", "loading", "removed"}
    assert set(spec.request.state_names) >= {"waiting", "loading", "running", "fenced", "finishing", "finished",
                                             "retracting", "retracted", "aborting", "aborted"}


def test_request_calls_agree_with_the_transitions() -> None:
    req = load_spec().request
    sources = {e: {t.source for t in req.transitions if t.event == e} for e in req.events}
    # step_done is the forward_result event; admit the schedule event (or a new record after an end)
    assert set(req.calls["step_done"]) == sources["forward_result"] == {"loading", "running", "fenced", "aborting"}
    assert set(req.calls["admit"]) == sources["schedule"] | {"finished", "aborted"}
    assert set(req.calls["reserve"]) == {"running", "loading"}
    # layer_ready may answer True only where the request holds device pages it reads
    readable = {s.name for s in req.states if "device pages" in s.resources} - {"fenced"}
    assert set(req.calls["layer_ready"]) == readable | {"aborting"}
    # one ack/fail vocabulary for both lifecycles
    node = load_spec().node
    assert {"loadback_ack", "loadback_fail", "writeback_ack", "writeback_fail"} <= set(req.events) & set(node.events)


def test_terminal_states_are_derived_from_the_spec() -> None:
    from kvtier.fsm.request import TERMINAL

    assert TERMINAL == {"finished", "aborted"}


def test_a_call_naming_an_undeclared_state_is_refused() -> None:
    text = MINIMAL.replace('[request.guards.ok]\ndoc = "G"\n',
                           '[request.guards.ok]\ndoc = "G"\n\n[request.calls]\nreserve = ["a", "zz"]\n')
    assert "[request.calls]" in text
    with pytest.raises(ConfigError, match=r"spec \[request\]: call 'reserve' lists undeclared state 'zz'"):
        parse_spec(text)
    assert parse_spec(text.replace('"zz"', '"b"')).request.calls == {"reserve": ("a", "b")}


def test_shipped_invariants_cover_the_reference_list() -> None:
    names = set(load_spec().invariants)
    mapped = {name for _, name in REFERENCE_INVARIANTS.values()}
    assert len(mapped) == 16
    assert names == mapped | EXTRA_INVARIANTS, (f"missing: {sorted(mapped - names)}; "
                                                f"unexplained: {sorted(names - mapped - EXTRA_INVARIANTS)}")
    assert all(statement.strip() for statement in load_spec().invariants.values())


def test_reference_titles_match_the_mapping() -> None:
    titles = dict(re.findall(r"^(\d+)\. \*\*(.+?)\*\*", INVARIANTS_MD.read_text(), flags=re.M))
    assert {int(k): v for k, v in titles.items()} == {k: t for k, (t, _) in REFERENCE_INVARIANTS.items()}


def _toml_names() -> dict[str, set[str]]:
    spec = load_spec()
    return {
        "state": {s for lc in spec.lifecycles for s in lc.state_names},
        "event": {e for lc in spec.lifecycles for e in lc.events},
        "guard": {g for lc in spec.lifecycles for g in lc.guards},
        "invariant": set(spec.invariants),
    }


def test_prose_names_every_state_event_guard_and_invariant() -> None:
    prose = spec_text("README.md")
    quoted = set(re.findall(r"`!?([a-z][a-z0-9_]*)`", prose))
    missing = {kind: sorted(names - quoted) for kind, names in _toml_names().items() if names - quoted}
    assert not missing, f"spec/README.md does not name (in backquotes): {missing}"


def test_prose_invariant_table_is_in_reference_order() -> None:
    rows = re.findall(r"^\| (\d+) \| `([a-z_]+)` \|", spec_text("README.md"), flags=re.M)
    assert [(int(n), name) for n, name in rows] == [(k, name) for k, (_, name) in REFERENCE_INVARIANTS.items()]


def test_spec_records_default_to_no_calls_and_no_l3_and_a_call_of_an_undeclared_state_is_refused() -> None:
    """spec.py:84, 138: a lifecycle built without calls has none (a fresh dict), a
    specification built without an L3 lifecycle has ``l3`` None; spec.py:180: a call that
    lists an undeclared state is refused naming both."""
    from pathlib import Path

    from kvtier.fsm.lifecycle.spec import LifecycleSpec, Specification, load_spec, parse_spec

    shipped = load_spec()
    node = shipped.node
    bare = LifecycleSpec(node.name, node.title, node.description, node.subject, node.initial, node.states,
                         node.transitions, node.guards, node.resources)
    assert bare.calls == {} and bare.calls is not LifecycleSpec(
        node.name, node.title, node.description, node.subject, node.initial, node.states, node.transitions,
        node.guards, node.resources).calls
    assert Specification(shipped.version, shipped.node, shipped.request, shipped.invariants).l3 is None
    text = (Path(__file__).parents[3] / "spec" / "lifecycle.toml").read_text(encoding="utf-8")
    bad = text.replace('reserve = ["loading", "running"]', 'reserve = ["loading", "nowhere"]')
    assert bad != text
    with pytest.raises(ConfigError) as e:
        parse_spec(bad)
    assert str(e.value) == "spec [request]: call 'reserve' lists undeclared state 'nowhere'"


def test_a_lifecycle_built_without_calls_accepts_no_call() -> None:
    """spec.py:84: ``LifecycleSpec.calls`` defaults to an empty dict (``[<lifecycle>.calls]``
    may be absent), a fresh one per record."""
    node = load_spec().node
    a = LifecycleSpec(node.name, node.title, node.description, node.subject, node.initial,
                      node.states, node.transitions, node.guards, node.resources)
    b = LifecycleSpec(node.name, node.title, node.description, node.subject, node.initial,
                      node.states, node.transitions, node.guards, node.resources)
    assert a.calls == {} and type(a.calls) is dict
    assert a.calls is not b.calls


def test_a_specification_built_without_l3_has_two_lifecycles() -> None:
    """``Specification.l3`` and ``.transfer`` default to None (a spec without ``[l3]`` or
    ``[transfer]``), and ``lifecycles`` then holds only the node and request lifecycles."""
    full = load_spec()
    spec = Specification(full.version, full.node, full.request, full.invariants)
    assert spec.l3 is None and spec.transfer is None
    assert spec.lifecycles == (full.node, full.request)
    assert full.l3 is not None and full.transfer is not None
    assert full.lifecycles == (full.node, full.request, full.l3, full.transfer)


def test_a_call_naming_an_undeclared_state_is_refused_with_the_exact_message() -> None:
    """spec.py:180: the whole message, naming the lifecycle, the call and the state."""
    text = MINIMAL.replace('[request.guards.ok]\ndoc = "G"\n',
                           '[request.guards.ok]\ndoc = "G"\n\n[request.calls]\nreserve = ["a", "zz"]\n')
    with pytest.raises(ConfigError) as exc:
        parse_spec(text)
    assert str(exc.value) == "spec [request]: call 'reserve' lists undeclared state 'zz'"
